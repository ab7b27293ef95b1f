"""Exactness of the sampling verifiers and of the child selection they rely on.

The exact tests enumerate every outcome of one speculative step with its probability:
- the draft's children, independently of the library: every ordered child sequence with its probability
  under the sampling mode, for every node of a small tree shape;
- the verifier's own random decisions, by running the real `verify` with a `RandomSource` that replays a
  script of choices and explores every branch (depth first), weighting each by the probability the
  verifier asked for (the Monte-Carlo tests then check that `TorchRandom` draws with those probabilities).
What one step emits (accepted path + bonus token) is extended with target samples up to a fixed length,
as the next steps would, and the resulting joint distribution is compared with sampling from the target alone.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest
import torch

from hf_specdec.core.tree import TokenTree
from hf_specdec.core.verdict import Verdict
from hf_specdec.logits.child_selection import select_children
from hf_specdec.runtime.pass_shapes import depth_first
from hf_specdec.verify import VERIFIERS, SequoiaVerifier, SpecInferVerifier, TargetSampleVerifier, TorchRandom
from tests.helpers.exactness import (
    SHAPES,
    TARGET_SAMPLING,
    WALKING,
    Case,
    all_runs,
    chi_square_pvalue,
    depth,
    draft_trees,
    sample_step,
    speculative_joint,
    target_joint,
    to_token_tree,
    total_variation,
    toy_logits,
)

# --------------------------------------------------------------------------- toy models: prefix -> distribution


class VocabularySubsetCase(Case):
    """A draft whose output layer covers `keep` only (`hf_specdec.restrict_vocabulary`): probability zero elsewhere."""

    def __init__(self, seed: int, vocab: int, keep: tuple[int, ...]):
        super().__init__(seed, vocab, banned=0.0)
        self.keep = torch.tensor(keep)

    def draft_q(self, prefix) -> torch.Tensor:
        logits = toy_logits(self.seed + 1000, prefix, self.vocab, 0.0, temperature=1.3)
        outside = torch.ones(self.vocab, dtype=torch.bool).index_fill_(0, self.keep, False)
        return logits.masked_fill(outside, float("-inf")).softmax(-1)


# --------------------------------------------------------------------------- independent draft enumeration


# --------------------------------------------------------------------------- enumerating the verifier's own draws


# --------------------------------------------------------------------------- the exact comparison


CASES = {
    "sparse": lambda v: Case(seed=3, vocab=v, banned=0.3),
    "very_sparse": lambda v: Case(seed=11, vocab=v, banned=0.6),
    "dense": lambda v: Case(seed=5, vocab=v, banned=0.0),
    "draft_equals_target": lambda v: Case(seed=7, vocab=v, same=True),
    "draft_vocab_larger": lambda v: Case(seed=9, vocab=v, banned=0.3, draft_vocab=v + 1),
    "draft_vocabulary_subset": lambda v: VocabularySubsetCase(seed=13, vocab=v, keep=(0, 1, 3)),
}


# The 2x2 tree enumerates thousands of drafts: two cases are enough there.
GRID = [(c, s) for c in CASES for s in SHAPES if s != "widths22" or c in ("sparse", "dense")]


@pytest.mark.parametrize("verifier_cls", WALKING)
@pytest.mark.parametrize("case_name,shape", GRID)
def test_exact_distribution(verifier_cls, shape, case_name):
    spec = SHAPES[shape]
    vocab = 4 if shape in ("widths22", "irregular") else 5
    case = CASES[case_name](vocab)
    length = depth(spec) + 1  # everything one step can emit; shorter emissions are extended by the target
    got, _ = speculative_joint(case, spec, verifier_cls(), length)
    want = target_joint(case, case.prompt, length)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert total_variation(got, want) < 1e-6
    first = lambda d: {k: sum(w for s, w in d.items() if s[0] == k) for k in range(vocab)}  # noqa: E731
    assert total_variation(first(got), first(want)) < 1e-6


def to_depth_first_tree(case: Case, nested) -> tuple[TokenTree, torch.Tensor]:
    """`to_token_tree`'s tree as the loop hands it to a target off the CPU: depth first (`core.pass_shapes`)."""
    tree, scores = to_token_tree(case, nested)
    ordered, kept = depth_first(tree, None, torch.device("cuda"))  # the device only names where the target runs
    return ordered, scores if kept is None else scores[kept]


@pytest.mark.parametrize("verifier_cls", WALKING)
@pytest.mark.parametrize("case_name,shape",
                         [("sparse", "irregular"), ("very_sparse", "irregular"), ("sparse", "widths22")])
def test_exact_distribution_depth_first(verifier_cls, shape, case_name):
    spec, vocab = SHAPES[shape], 4
    case = CASES[case_name](vocab)
    length = depth(spec) + 1
    got, _ = speculative_joint(case, spec, verifier_cls(), length, build=to_depth_first_tree)
    assert total_variation(got, target_joint(case, case.prompt, length)) < 1e-6


def batch_joint(cases: list[Case], specs: list[list], verifier, lengths: list[int]) -> dict:
    """Exact joint distribution of every row's next `lengths[r]` tokens when one batch step drafts each row's tree
    and verifies all rows at once, as the batch loop does (`Verifier.verify_rows`, the rows drawing from one random
    source one after another); each row's emission is extended by target samples, independently per row."""
    out: dict = defaultdict(float)
    drafts = [list(draft_trees(case, case.prompt, spec, verifier.child_selection)) for case, spec in zip(cases, specs)]
    for combo in itertools.product(*drafts):
        built = [to_token_tree(case, nested) for case, (_, nested) in zip(cases, combo)]
        trees, scores = [tree for tree, _ in built], [row_scores for _, row_scores in built]
        tree_prob = math.prod(prob for prob, _ in combo)
        for run_prob, verdicts in all_runs(lambda src, trees=trees, scores=scores: verifier.verify_rows(
                trees, scores, None, source=src)):
            rows = []
            for case, tree, verdict, length in zip(cases, trees, verdicts, lengths):
                tokens = tree.tokens.tolist()
                emitted = tuple(tokens[i] for i in verdict.path[1:]) + (verdict.bonus_token,)
                rows.append(target_joint(case, case.prompt, length, emitted).items())
            for outcome in itertools.product(*rows):
                key = tuple(row for row, _ in outcome)
                out[key] += tree_prob * run_prob * math.prod(w for _, w in outcome)
    return out


@pytest.mark.parametrize("verifier_cls", WALKING)
def test_batch_step_exact_per_row_and_rows_independent(verifier_cls):
    """One step of a batch of two rows (different models, prompts and tree shapes), every outcome enumerated: the
    joint distribution of the rows' next tokens is the product of sampling each row from its target alone, so every
    row is exact and no row's draws lean on another's, as in plain batched sampling."""
    vocab = 4
    cases = [CASES["sparse"](vocab), CASES["dense"](vocab)]
    cases[1].prompt = (2,)
    specs = [SHAPES["chain2"], SHAPES["star3"]]
    lengths = [depth(spec) + 1 for spec in specs]
    got = batch_joint(cases, specs, verifier_cls(), lengths)
    alone = [target_joint(case, case.prompt, length) for case, length in zip(cases, lengths)]
    want = {(a, b): wa * wb for a, wa in alone[0].items() for b, wb in alone[1].items()}
    assert abs(sum(got.values()) - 1) < 1e-9
    assert total_variation(got, want) < 1e-6


def test_exact_with_mismatched_supports():
    """q puts mass only where p has none, and vice versa: nothing is accepted, yet the output is exact."""
    vocab = 5
    case = Case(seed=0, vocab=vocab)
    case.target_scores = lambda prefix: torch.tensor([0.0, 1.0, -math.inf, -math.inf, 0.5])
    case.draft_q = lambda prefix: torch.tensor([0.0, 0.0, 0.7, 0.3, 0.0])
    for cls in (SequoiaVerifier, SpecInferVerifier):
        got, accepted = speculative_joint(case, [[], []], cls(), 2)
        assert total_variation(got, target_joint(case, case.prompt, 2)) < 1e-9
        assert accepted == 0.0


@pytest.mark.parametrize("verifier_cls", TARGET_SAMPLING)
def test_target_sample_exact_on_arbitrary_fixed_trees(verifier_cls):
    """Any tree fixed in advance works: banned tokens, duplicated siblings, every token drafted."""
    case = Case(seed=21, vocab=5, banned=0.4)
    for nested in ([(3, [(0, [])]), (2, []), (3, [(1, [])])], [(t, [(t, [])]) for t in range(5)]):
        got, _ = speculative_joint(case, None, verifier_cls(), 3, trees=[(1.0, nested)])
        assert total_variation(got, target_joint(case, case.prompt, 3)) < 1e-9


@pytest.mark.parametrize("verifier_cls", [SequoiaVerifier, SpecInferVerifier])
def test_child_the_draft_cannot_propose_is_ignored(verifier_cls):
    """A child with q = 0 (e.g. added by hand) is skipped, so the rest of the tree stays exact."""
    case = Case(seed=0, vocab=5)
    case.target_scores = lambda prefix: torch.tensor([0.0, 1.0, -math.inf, 0.2, 0.5])
    case.draft_q = lambda prefix: torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    trees = [(w, [(1, []), *t]) for w, t in draft_trees(case, case.prompt, [[], []], verifier_cls.child_selection)]
    got, _ = speculative_joint(case, None, verifier_cls(), 2, trees=trees)
    assert total_variation(got, target_joint(case, case.prompt, 2)) < 1e-9


def test_draft_equals_target_accepts_first_child():
    case = CASES["draft_equals_target"](5)
    for cls in (SequoiaVerifier, SpecInferVerifier):
        _, accepted = speculative_joint(case, SHAPES["star3"], cls(), 2)
        assert accepted == pytest.approx(1.0, abs=1e-6)


# --------------------------------------------------------------------------- the real randomness


@pytest.mark.parametrize("verifier_cls", WALKING)
def test_monte_carlo_matches_target(verifier_cls):
    case = Case(seed=3, vocab=5, banned=0.2)
    cache_t, cache_q = {}, {}
    target_scores, draft_q = case.target_scores, case.draft_q
    case.target_scores = lambda p: cache_t.setdefault(p, target_scores(p))
    case.draft_q = lambda p: cache_q.setdefault(p, draft_q(p))
    generator, n = torch.Generator().manual_seed(1234), 6000
    counts = defaultdict(int)
    for _ in range(n):
        counts[sample_step(case, [2, 2], verifier_cls(), generator)] += 1
    want = target_joint(case, case.prompt, 2)
    assert chi_square_pvalue(counts, want, n) > 1e-3
    assert total_variation({k: c / n for k, c in counts.items()}, want) < 0.03


# --------------------------------------------------------------------------- protocol details


def test_registered_and_protocol():
    for name, cls in [
        ("sequoia", SequoiaVerifier),
        ("specinfer", SpecInferVerifier),
        ("target_sample", TargetSampleVerifier),
    ]:
        assert VERIFIERS[name] is cls
        assert cls.child_selection in ("top_k", "without_replacement", "with_replacement")


def test_a_verifier_builds_on_the_contract_the_loops_read():
    """The loops read `walks` and `verify_rows` from the `Verifier` contract, which declares both with defaults: a
    class that is not a Verifier is refused at registration, naming the fix; a Verifier that only implements
    `verify` verifies a batch row by row, the rows drawing one after another."""
    from hf_specdec import Verifier
    from hf_specdec.verify import register_verifier

    class Loose:
        name, child_selection = "loose", "top_k"

        def verify(self, tree, target_scores, generator=None):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="subclass hf_specdec.Verifier"):
        register_verifier(Loose)
    assert "loose" not in VERIFIERS

    class FirstChild(Verifier):
        name, child_selection = "first_child", "top_k"
        seen: list = []

        def verify(self, tree, target_scores, generator=None):
            self.seen.append(len(tree))
            return Verdict(path=[0], bonus_token=int(target_scores[0].argmax()), accepted_ranks=[])

    trees = [TokenTree.from_parents(torch.tensor([5, 6]), [-1, 0]), TokenTree.from_parents(torch.tensor([7]), [-1])]
    scores = [torch.eye(8)[[3, 4]], torch.eye(8)[[2]]]
    verdicts = FirstChild().verify_rows(trees, scores)
    assert not FirstChild.walks and FirstChild.seen == [2, 1] and [v.bonus_token for v in verdicts] == [3, 2]


@pytest.mark.parametrize("verifier_cls", [SequoiaVerifier, SpecInferVerifier, TargetSampleVerifier])
def test_seeded_generator_reproduces(verifier_cls):
    case = Case(seed=4, vocab=6, banned=0.0)
    runs = []
    for seed in (7, 7, 8):
        g = torch.Generator().manual_seed(seed)
        runs.append([sample_step(case, [3, 2], verifier_cls(), g) for _ in range(30)])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_acceptance_ranks_reported():
    """Root: p is a point mass on token 2, children 0, 1, 2 drafted in that order from q uniform over them;
    node 3 (token 2) has one child, token 3, which both target and draft are sure of."""
    q = torch.tensor([[1 / 3] * 3 + [0.0] * 7] * 5)
    q[3] = torch.nn.functional.one_hot(torch.tensor(3), 10).float()
    tree = TokenTree.from_parents([9, 0, 1, 2, 3], [-1, 0, 0, 0, 3], draft_probs=q)
    scores = torch.full((5, 10), -math.inf)
    scores[0, 2] = 0.0
    scores[1:, 3] = 0.0
    for cls in (SequoiaVerifier, SpecInferVerifier, *TARGET_SAMPLING):
        verdict = cls().verify(tree, scores, torch.Generator().manual_seed(0))
        assert verdict.path == [0, 3, 4] and verdict.accepted_ranks == [2, 0] and verdict.bonus_token == 3


def test_missing_draft_probs_is_an_error():
    tree = TokenTree.from_parents([0, 1], [-1, 0])
    with pytest.raises(ValueError, match="draft_probs"):
        SequoiaVerifier().verify(tree, torch.zeros(2, 4))
    assert TargetSampleVerifier().verify(tree, torch.zeros(2, 4), torch.Generator().manual_seed(0)).bonus_token >= 0


def test_torch_random_decide_rates():
    """Trials succeed with their own probabilities and the first success wins (k: none did); the token is drawn from
    its distribution, independently of the trials; both stay unread `(1,)` tensors on their inputs' device."""
    src = TorchRandom(torch.Generator().manual_seed(0))
    residual = torch.tensor([0.0, 0.25, 0.75], dtype=torch.float64)
    rank, token = src.decide(torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64), residual)
    assert rank.shape == token.shape == (1,) and rank.dtype == token.dtype == torch.long and int(rank) == 1
    assert int(src.decide(torch.tensor([0.0, 0.0], dtype=torch.float64), torch.eye(3)[2])[0]) == 2
    assert [int(t) for t in src.decide(torch.zeros(0, dtype=torch.float64), torch.eye(3)[0])] == [0, 0]
    n, accept = 20000, torch.tensor([0.3, 0.5], dtype=torch.float64)
    counts = defaultdict(int)
    for _ in range(n):
        rank, token = src.decide(accept, residual)
        counts[int(rank), int(token)] += 1
    want = {(r, t): w * float(residual[t]) for r, w in ((0, 0.3), (1, 0.35), (2, 0.35)) for t in (1, 2)}
    assert chi_square_pvalue(counts, want, n) > 1e-3


def test_torch_random_draws_by_mass_and_never_a_column_without_it():
    """Inverse transform draws: frequencies as the distribution's, zero-mass columns (first, inner, last) never
    drawn."""
    src = TorchRandom(torch.Generator().manual_seed(1))
    dist = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0], dtype=torch.float64)
    n, counts = 20000, defaultdict(int)
    for _ in range(n):
        counts[int(src.draw(dist))] += 1
    assert set(counts) <= {1, 3, 4}
    assert chi_square_pvalue(counts, {t: float(dist[t]) for t in (1, 3, 4)}, n) > 1e-3
    assert all(int(src.draw(torch.eye(6, dtype=torch.float64)[t])) == t for t in range(6))


def test_torch_random_draws_a_pair_by_mass_on_its_columns():
    """A distribution given as (probs, columns): each column drawn with its mass (a repeated column's masses add),
    a column of no mass never; the token comes back as the column, on the device, unread."""
    src = TorchRandom(torch.Generator().manual_seed(2))
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0], dtype=torch.float64)
    columns = torch.tensor([90_000, 7, 12, 90_000, 151_935])
    n, counts = 20000, defaultdict(int)
    for _ in range(n):
        counts[int(src.draw((probs, columns)))] += 1
    assert set(counts) <= {90_000, 12}
    assert chi_square_pvalue(counts, {90_000: 0.8, 12: 0.2}, n) > 1e-3
    assert int(src.draw((torch.tensor([0.0, 1.0]), torch.tensor([4, 9])))) == 9


# --------------------------------------------------------------------------- select_children


def test_select_children_shapes_and_padding():
    probs = torch.tensor([[0.5, 0.2, 0.3, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0], [0.1, 0.2, 0.4, 0.25, 0.05]])
    g = torch.Generator().manual_seed(0)
    out = select_children(probs, [3, 2, 1], "without_replacement", g)
    assert out.shape == (3, 3) and out.dtype == torch.long
    assert sorted(out[0].tolist()) == [0, 1, 2]
    assert out[1].tolist() == [2, -1, -1]
    assert out[2, 0] >= 0 and out[2, 1:].tolist() == [-1, -1]
    top = select_children(torch.log(probs), 3, "top_k", g)
    assert top.tolist() == [[0, 2, 1], [2, -1, -1], [2, 3, 1]]
    rep = select_children(probs, 4, "with_replacement", g)
    assert rep.shape == (3, 4) and bool((rep >= 0).all()) and rep[1].tolist() == [2, 2, 2, 2]
    assert select_children(torch.zeros(2, 5), 2, "with_replacement", g).tolist() == [[-1, -1], [-1, -1]]
    assert select_children(probs, 0, "top_k", g).shape == (3, 0)
    with pytest.raises(ValueError):
        select_children(probs, 2, "nucleus", g)


def test_select_children_without_replacement_order_distribution():
    q = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    n = 40000
    draws = select_children(q.expand(n, -1), 2, "without_replacement", torch.Generator().manual_seed(5))
    assert bool((draws[:, 0] != draws[:, 1]).all()) and bool((draws >= 0).all()) and bool((draws != 4).all())
    counts = defaultdict(int)
    for a, b in draws.tolist():
        counts[(a, b)] += 1
    want = {(a, b): float(q[a] * q[b] / (1 - q[a])) for a in range(4) for b in range(4) if a != b}
    assert chi_square_pvalue(counts, want, n) > 1e-3


def test_select_children_with_replacement_is_iid():
    q = torch.tensor([0.5, 0.3, 0.2])
    n = 30000
    draws = select_children(q.expand(n, -1), 2, "with_replacement", torch.Generator().manual_seed(6))
    counts = defaultdict(int)
    for a, b in draws.tolist():
        counts[(a, b)] += 1
    want = {(a, b): float(q[a] * q[b]) for a in range(3) for b in range(3)}
    assert chi_square_pvalue(counts, want, n) > 1e-3
