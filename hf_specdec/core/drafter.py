"""The drafter contract: propose a TokenTree, learn what was accepted.

Drafters extend Transformers' `CandidateGenerator` so a chain drafter also runs inside the stock
assisted-generation loop (`get_candidates` returns the tree's first path as a chain).
"""

from __future__ import annotations

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .model_inputs import TokenInputs
from .tree import TokenTree
from .verdict import Verdict


class Drafter(CandidateGenerator):
    """Proposes a tree of continuations of `input_ids` rooted at its last token."""

    #: draft-model forward passes so far, and the seconds they took (stats)
    forward_count: int = 0
    forward_time: float = 0.0
    #: proposals a per-step sizing cut below the method's full tree (stats)
    shrunk_steps: int = 0
    #: proposals larger than any target pass a per-step sizing had timed in the call (stats)
    size_probes: int = 0
    #: levels a per-step sizing drafted below the shape it had chosen, the draft staying sure (stats)
    deepened_levels: int = 0

    @property
    def draft_pass_sizes(self) -> set[int]:
        """The pass sizes the draft model ran on a static cache (stats; none for a drafter without one)."""
        return set()

    @property
    def draft_sizes_kept_eager(self) -> set[int]:
        """Those of `draft_pass_sizes` a compiled call kept eager, having measured it no faster (stats)."""
        return set()

    def propose(self, input_ids: torch.LongTensor) -> TokenTree:
        raise NotImplementedError

    def propose_ids(self, ids: list[int]) -> TokenTree:
        """`propose` for a sequence the caller holds on the host (a staged stack's lower stages): drafters that work
        on the host override it and read no tensor."""
        return self.propose(torch.tensor([ids]))

    def use_inputs(self, inputs: TokenInputs) -> None:
        """The call's per-token inputs (token types; see `core.model_inputs`): drafters that run a model give them
        to its passes, by position. A draft only proposes, so going without changes no output, only acceptance."""

    def use_static_cache(self, rows: int, compiled) -> None:
        """The target decodes on a static cache of `rows` rows: drafters that run a model move it onto a static cache
        too, its padded passes run through `compiled(model, cache)` (a compiled call, or None: eager)."""

    def use_window(self, tokens: int | None) -> None:
        """Drafters that run a model let it read only the prompt's last `tokens` tokens (None: all of it): a cheaper
        draft over long prompts; output unchanged, as the draft only proposes."""

    def share_rows(self, rows: int) -> None:
        """The drafter now drafts one of `rows` rows of a batch whose target pass verifies every row's tree together:
        drafters that size trees by the target's latency curve price their tree as one row's share of that pass."""

    def observe_target_pass(self, tree_size: int, seconds: float) -> None:
        """The target's pass over the last proposed tree (`tree_size` nodes) took `seconds`: drafters that size trees
        by a cost model correct their latency curve with it."""

    def accept(self, input_ids: torch.LongTensor, tree: TokenTree, verdict: Verdict) -> None:
        """`input_ids` now ends with the accepted path and the bonus token: bring internal state up to date."""

    # --- Transformers' CandidateGenerator contract -------------------------------------------------
    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one proposal drafts below its root: Transformers' assisted loop (5.25 on) keeps that
        many recurrent states of a stateful target to roll back to."""
        raise NotImplementedError(f"{type(self).__name__} does not say how deep it drafts (num_drafting_tokens).")

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """The tree's first-child chain, as assisted generation expects: `(input_ids + chain, chain scores)`."""
        tree = self.propose(input_ids)
        chain = first_child_chain(tree)
        candidates = torch.cat([input_ids, tree.tokens[chain[1:]].to(input_ids.device)[None]], dim=1)
        chain_scores = self.node_scores(chain[:-1]) if len(chain) > 1 else None
        return candidates, None if chain_scores is None else chain_scores[None]

    def node_scores(self, nodes: list[int]) -> torch.Tensor | None:
        """Processed draft scores `(len(nodes), vocab)` at nodes of the last proposed tree, if the drafter has them."""
        return None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        pass


def first_child_chain(tree: TokenTree) -> list[int]:
    """Root, its first child, that child's first child, ... (the most likely path of a top-k tree)."""
    parents = tree.parents.tolist()
    first_child: dict[int, int] = {}
    for child, parent in enumerate(parents):
        if parent >= 0:
            first_child.setdefault(parent, child)
    chain = [0]
    while chain[-1] in first_child:
        chain.append(first_child[chain[-1]])
    return chain
