"""The model-family matrix's cases: a tiny model of each family, the prompt and the methods every family runs."""

from __future__ import annotations

import functools

import torch

from hf_specdec import plan_tree
from hf_specdec.accept.kv_cache import full_length_cache
from hf_specdec.core.releases import cache_arg
from hf_specdec.decoding.step import tree_pass
from hf_specdec.runtime.attention import AttentionLayout
from tests.families import Family, family
from tests.helpers.exactness import Case, to_token_tree

PROMPT = 10


NEW_TOKENS = 40


METHODS = {
    "tree": {},  # default widths [4, 2, 1, 1]
    "sequoia": {"plan": plan_tree([0.7, 0.15, 0.05], 16, 6)},
    "specexec": {"budget": 16, "max_depth": 6},
    "staged": {"budget": 32},  # prompt lookup under the draft; a fixed budget: sized every step, a busy machine's
    # timings can make every step plain (a tiny draft costs what its target does), and this test needs speculation
}


@functools.cache
def tiny(name: str, seed: int = 0, vocab_size: int | None = None):
    return family(name).build(seed, vocab_size)


def prompt(length: int = PROMPT, vocab: int = 96, seed: int = 0) -> torch.LongTensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def new_tokens(entry: Family) -> int:
    """Long enough to cross the window many times; for learned positions, up to the last position there is."""
    return NEW_TOKENS if entry.position_limit is None else entry.position_limit + 1 - PROMPT


SAMPLING_VOCAB = 5


TEMPERATURE = 0.7


class ModelCase(Case):
    """A tiny-vocabulary target and draft of one family after a fixed context: the reference scores are plain causal
    passes over context + prefix; `build` scores a drafted tree by the real verification pass (full-length cache, tree
    masks)."""

    def __init__(self, entry: Family, context_length: int):
        super().__init__(seed=0, vocab=SAMPLING_VOCAB)
        self.target = tiny(entry.name, 0, SAMPLING_VOCAB)
        self.draft = tiny(entry.name, 1, SAMPLING_VOCAB)
        self.context = torch.randint(0, SAMPLING_VOCAB, (context_length,), generator=torch.Generator().manual_seed(3))
        self.prompt = (int(self.context[-1]),)
        self.layout = AttentionLayout.of(self.target)
        self._memo: dict = {}

    def _causal(self, model, prefix) -> torch.Tensor:
        key = (id(model), prefix)
        if key not in self._memo:
            ids = torch.cat([self.context[:-1], torch.tensor(prefix)])[None]
            with torch.no_grad():
                self._memo[key] = model(ids).logits[0, -1].float()
        return self._memo[key]

    def target_scores(self, prefix) -> torch.Tensor:
        return self._causal(self.target, prefix) / TEMPERATURE

    def draft_q(self, prefix) -> torch.Tensor:
        return self._causal(self.draft, prefix).softmax(-1)

    def build(self, case, nested):
        tree, _ = to_token_tree(case, nested)
        return tree, self.tree_scores(tree)

    def tree_scores(self, tree) -> torch.Tensor:
        past = len(self.context) - 1
        cache = full_length_cache(None)
        with torch.no_grad():
            self.target(self.context[None, :-1], **cache_arg(cache), use_cache=True)
            output = tree_pass(self.target, tree, past, cache, self.layout, torch.float32, torch.device("cpu"))
        return output.logits[0].float() / TEMPERATURE
