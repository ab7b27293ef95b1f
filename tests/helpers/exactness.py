"""Exactness by enumeration: toy targets and drafts over a tiny vocabulary, the joint distribution of a speculative
step's tokens against the target's own, and the statistics that compare them."""

from __future__ import annotations

import itertools
import math
import zlib
from collections import defaultdict

import torch
from transformers import LogitsProcessorList

from hf_specdec.core.tree import TokenTree
from hf_specdec.logits.child_selection import select_children
from hf_specdec.verify import SequoiaVerifier, SpecInferVerifier, TargetSampleVerifier


def toy_logits(seed: int, prefix: tuple[int, ...], vocab: int, banned: float, temperature: float) -> torch.Tensor:
    """Deterministic pseudo-random logits for a prefix; about `banned` of the tokens set to -inf (never all)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((seed, prefix)).encode()))
    logits = torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5 / temperature
    ban = torch.rand(vocab, generator=g) < banned
    ban[int(torch.randint(vocab, (1,), generator=g))] = False
    return logits.masked_fill(ban, float("-inf")).float()


class Case:
    """A target and a draft model over a tiny vocabulary, plus the prompt's last token."""

    def __init__(self, seed: int, vocab: int, banned: float = 0.3, draft_vocab: int | None = None, same=False):
        self.seed, self.vocab, self.banned = seed, vocab, banned
        self.draft_vocab = draft_vocab or vocab
        self.same = same  # draft == target exactly
        self.prompt = (1,)

    def target_scores(self, prefix) -> torch.Tensor:
        return toy_logits(self.seed, prefix, self.vocab, self.banned, temperature=0.7)

    def target_p(self, prefix) -> list[float]:
        return self.target_scores(prefix).double().softmax(-1).tolist()

    def draft_q(self, prefix) -> torch.Tensor:
        if self.same:
            return self.target_scores(prefix).softmax(-1)
        return toy_logits(self.seed + 1000, prefix, self.draft_vocab, self.banned, temperature=1.3).softmax(-1)


def ordered_children(q: list[float], k: int, mode: str):
    """Every (probability, child token sequence) the drafter can produce at a node with draft distribution q."""
    support = [t for t, w in enumerate(q) if w > 0]
    if mode == "top_k":
        yield 1.0, sorted(range(len(q)), key=lambda t: -q[t])[:k]
    elif mode == "with_replacement":
        for seq in itertools.product(support, repeat=k):
            yield math.prod(q[t] for t in seq), list(seq)
    else:  # without replacement: fewer children when the support is smaller than k
        for seq in itertools.permutations(support, min(k, len(support))):
            prob, left = 1.0, 1.0
            for t in seq:
                prob, left = prob * q[t] / left, left - q[t]
            yield prob, list(seq)


def draft_trees(case: Case, prefix: tuple[int, ...], spec: list, mode: str):
    """Every (probability, subtree) for a shape `spec` (a list of child specs); subtree = [(token, subtree)]."""
    if not spec:
        yield 1.0, []
        return
    q = case.draft_q(prefix).double().tolist()
    q = [w / sum(q) for w in q]
    for prob, seq in ordered_children(q, len(spec), mode):
        subs = [list(draft_trees(case, prefix + (t,), spec[i], mode)) for i, t in enumerate(seq)]
        for combo in itertools.product(*subs):
            yield prob * math.prod(c[0] for c in combo), [(t, c[1]) for t, c in zip(seq, combo)]


def to_token_tree(case: Case, nested) -> tuple[TokenTree, torch.Tensor]:
    """BFS-order TokenTree with draft_probs and the target scores of every node."""
    tokens, parents, prefixes, queue = [case.prompt[-1]], [-1], [case.prompt], [(0, nested)]
    while queue:
        node, kids = queue.pop(0)
        for token, sub in kids:
            tokens.append(token)
            parents.append(node)
            prefixes.append(prefixes[node] + (token,))
            queue.append((len(tokens) - 1, sub))
    draft = torch.stack([case.draft_q(p) for p in prefixes])
    tree = TokenTree.from_parents(tokens, parents, draft_probs=draft)
    return tree, torch.stack([case.target_scores(p) for p in prefixes])


class Script:
    """A RandomSource that takes the branches listed in `prefix`, then branch 0, recording every decision."""

    def __init__(self, prefix: list[int]):
        self.prefix, self.taken, self.widths, self.weight = prefix, [], [], 1.0

    def _choose(self, options: list[tuple[object, float]]):
        options = [o for o in options if o[1] > 0]
        i = self.prefix[len(self.taken)] if len(self.taken) < len(self.prefix) else 0
        self.taken.append(i)
        self.widths.append(len(options))
        self.weight *= options[i][1]
        return options[i][0]

    def decide(self, accept, dist):
        """The first successful trial (`len(accept)` where none succeeds), enumerated now, and where none succeeds a
        token of `dist`, enumerated too; where one succeeds the token means nothing and is not enumerated (-1)."""
        probs = accept.tolist()
        assert all(0.0 <= a <= 1.0 for a in probs)
        options, missed = [], 1.0
        for i, a in enumerate(probs):
            options.append((i, missed * a))
            missed *= 1.0 - a
        rank = self._choose([*options, (len(probs), missed)])
        return torch.tensor([rank]), self.draw(dist) if rank == len(probs) else torch.tensor([-1])

    def draw(self, dist):
        """A token of `dist`, enumerated now: a walk on the device draws level after level before it reads."""
        return torch.tensor([self._choose(options(dist))])


def options(dist) -> list[tuple[int, float]]:
    """(token, probability) of a distribution: a `(V,)` tensor, or a pair `(probs, columns)` (mass probs[j] on token
    columns[j]; a repeated column is enumerated once per entry, its branches adding up)."""
    probs, tokens = (dist.tolist(), range(len(dist))) if isinstance(dist, torch.Tensor) else (
        dist[0].tolist(), dist[1].tolist())
    assert abs(sum(probs) - 1) < 1e-9 and all(p >= 0 for p in probs)
    return list(zip(tokens, probs))


def all_runs(run):
    """Yield (probability, result) for every branch of `run(source)`."""
    stack = [[]]
    while stack:
        script = Script(stack.pop())
        result = run(script)
        yield script.weight, result
        for d in range(len(script.prefix), len(script.taken)):
            stack.extend(script.taken[:d] + [alt] for alt in range(1, script.widths[d]))


def target_joint(case: Case, prefix: tuple[int, ...], length: int, head=(), prob=1.0, out=None) -> dict:
    """Distribution of the next `length` tokens sampled from the target alone, given already-emitted `head`."""
    out = defaultdict(float) if out is None else out
    if len(head) >= length:
        out[tuple(head[:length])] += prob
        return out
    for t, w in enumerate(case.target_p(prefix + tuple(head))):
        if w > 0:
            target_joint(case, prefix, length, head + (t,), prob * w, out)
    return out


def speculative_joint(
    case: Case, spec: list, verifier, length: int, trees=None, build=to_token_tree
) -> tuple[dict, float]:
    """Exact distribution of the next `length` tokens when this step is speculative; and P(any draft accepted).

    `build(case, nested)` gives the TokenTree of a drafted tree and the target scores of its nodes."""
    out, accepted = defaultdict(float), 0.0
    for tree_prob, nested in (
        trees if trees is not None else draft_trees(case, case.prompt, spec, verifier.child_selection)
    ):
        tree, scores = build(case, nested)
        tokens = tree.tokens.tolist()
        for run_prob, verdict in all_runs(
            lambda src, tree=tree, scores=scores: verifier.verify(tree, scores, source=src)
        ):
            emitted = tuple(tokens[i] for i in verdict.path[1:]) + (verdict.bonus_token,)
            assert len(verdict.accepted_ranks) == len(verdict.path) - 1
            accepted += tree_prob * run_prob * (len(verdict.path) > 1)
            target_joint(case, case.prompt, length, emitted, tree_prob * run_prob, out)
    return out, accepted


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


class OneReadTargetSample(TargetSampleVerifier):
    """Target sampling as on an accelerator: every level of the walk runs on the device, then one read."""

    stop_early = False


class OneReadSequoia(SequoiaVerifier):
    """Recursive rejection sampling as on an accelerator: every level of the walk on the device, then one read."""

    stop_early = False


TARGET_SAMPLING = [TargetSampleVerifier, OneReadTargetSample]
RESIDUAL = [SequoiaVerifier, SpecInferVerifier, OneReadSequoia]
WALKING = [*RESIDUAL, *TARGET_SAMPLING]  # every walk, in both of its read modes
#: for enumerations over wide vocabularies: a one-read residual walk enumerates its draws past the walk's end too
#: (minutes there); its levels are the CPU mode's, enumerated on the small vocabularies in test_sampling_exact.py
WIDE_VOCABULARY_WALKS = [SequoiaVerifier, SpecInferVerifier, *TARGET_SAMPLING]


def depth(spec: list) -> int:
    return 1 + max((depth(s) for s in spec), default=0) if spec else 0


SHAPES = {
    "chain2": [[[]]],
    "star3": [[], [], []],
    "widths22": [[[], []], [[], []]],
    "irregular": [[[], []], [[]], []],
}


def chi_square_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Pearson chi-square goodness of fit, cells with expected count < 5 pooled; survival via gammaincc."""
    cells, pooled_obs, pooled_exp = [], 0.0, 0.0
    for k, p in probs.items():
        if p * n >= 5:
            cells.append((counts.get(k, 0), p * n))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(k, 0), pooled_exp + p * n
    assert sum(c for k, c in counts.items() if probs.get(k, 0) == 0) == 0, "sampled an impossible sequence"
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def sample_step(case: Case, shape: list[int], verifier, generator: torch.Generator | None) -> tuple[int, int]:
    """One real step: draft with `select_children`, verify, then extend to two tokens with the target. The tree lives
    where the case's rows do, as in the engine (tests/test_cuda.py runs it with rows on a GPU)."""
    tokens, parents, prefixes, frontier = [case.prompt[-1]], [-1], [case.prompt], [0]
    for width in shape:
        q = torch.stack([case.draft_q(prefixes[i]) for i in frontier])
        kids = select_children(q, width, verifier.child_selection, generator)
        new = []
        for row, parent in enumerate(frontier):
            for t in kids[row].tolist():
                if t >= 0:
                    tokens.append(t)
                    parents.append(parent)
                    prefixes.append(prefixes[parent] + (t,))
                    new.append(len(tokens) - 1)
        frontier = new
    draft_probs = torch.stack([case.draft_q(p) for p in prefixes])
    tree = TokenTree.from_parents(torch.tensor(tokens, device=draft_probs.device), parents, draft_probs=draft_probs)
    verdict = verifier.verify(tree, torch.stack([case.target_scores(p) for p in prefixes]), generator)
    emitted = [tokens[i] for i in verdict.path[1:]] + [int(verdict.bonus_token)]
    if len(emitted) < 2:
        emitted.append(
            int(torch.multinomial(case.target_scores(case.prompt + (emitted[0],)).softmax(-1), 1, generator=generator))
        )
    return emitted[0], emitted[1]


class ProcessedCase(Case):
    """Toy target logits for a prefix, processed by `processors` with that prefix (the reference: plain generate)."""

    def __init__(self, seed: int, vocab: int, processors: LogitsProcessorList, prompt: tuple[int, ...], same: bool):
        super().__init__(seed, vocab, banned=0.0, same=same)  # same: the draft is the processed target (all accepted)
        self.processors, self.prompt = processors, prompt
        self._scores: dict[tuple[int, ...], torch.Tensor] = {}

    def raw(self, prefix: tuple[int, ...]) -> torch.Tensor:
        return toy_logits(self.seed, prefix, self.vocab, 0.0, temperature=0.7)

    def target_scores(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._scores:
            self._scores[prefix] = self.processors(torch.tensor([prefix]), self.raw(prefix)[None])[0]
        return self._scores[prefix]


