"""Exact sampling when the logits processors depend on the prefix (repetition_penalty, no_repeat_ngram_size).

One speculative step is enumerated exactly, as in tests/test_sampling_exact.py, but the target's node scores are
raw toy logits processed by the real `process_tree_scores` with real Transformers processors, while the reference
applies the same processors to each full sequence alone, as plain `generate` does. Enumeration is exact, so the
tolerance (1e-6) is far below the errors that matter: a verifier wrong with probability 0.002 is caught, and so is
a mutant `process_tree_scores` that processes every node with the root's prefix.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_specdec import TokenTree
from hf_specdec.logits import processing
from hf_specdec.verify import SequoiaVerifier, SpecInferVerifier, TargetSampleVerifier, Verdict, walk
from tests.helpers.exactness import (
    SHAPES,
    TARGET_SAMPLING,
    WIDE_VOCABULARY_WALKS,
    ProcessedCase,
    depth,
    speculative_joint,
    target_joint,
    to_token_tree,
    total_variation,
    toy_logits,
)

TOLERANCE = 1e-6
PROCESSORS = {
    "repetition_penalty": lambda: LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(1.8), TemperatureLogitsWarper(0.8)]
    ),
    "no_repeat_ngram_size": lambda: LogitsProcessorList(
        [NoRepeatNGramLogitsProcessor(2), RepetitionPenaltyLogitsProcessor(1.3)]
    ),
}
VERIFIERS = [SequoiaVerifier, SpecInferVerifier, TargetSampleVerifier]


def processed_tree(case: ProcessedCase, nested) -> tuple:
    """The drafted tree, and its node scores as the loop computes them: raw logits through process_tree_scores."""
    tree, _ = to_token_tree(case, nested)
    tokens = tree.tokens.tolist()
    raw = torch.stack([case.raw(case.prompt + tuple(tokens[i] for i in tree.path_to(n)[1:])) for n in range(len(tree))])
    prefix_ids = torch.tensor([case.prompt[:-1]])  # the loop's prefix ends before the root
    return tree, processing.process_tree_scores(case.processors, prefix_ids, tree, raw)


def step_error(processors: str, shape: str, verifier, draft: str = "toy") -> float:
    """Total variation between what one speculative step (extended by target samples) emits and plain sampling."""
    case = ProcessedCase(17, 4, PROCESSORS[processors](), prompt=(1, 2, 1), same=draft == "target")
    spec = SHAPES[shape]
    length = depth(spec) + 1
    got, _ = speculative_joint(case, spec, verifier, length, build=processed_tree)
    assert abs(sum(got.values()) - 1) < 1e-9
    return total_variation(got, target_joint(case, case.prompt, length))


def check_exact(processors: str, shape: str, verifier, draft: str = "toy") -> None:
    assert step_error(processors, shape, verifier, draft) < TOLERANCE


GRID = [(p, s, d) for p in sorted(PROCESSORS) for s in ("chain2", "star3") for d in ("toy", "target")]


@pytest.mark.parametrize("verifier_cls", VERIFIERS)
@pytest.mark.parametrize("processors,shape,draft", GRID)
def test_exact_with_prefix_dependent_processors(processors, shape, draft, verifier_cls):
    check_exact(processors, shape, verifier_cls(), draft)


@pytest.mark.parametrize("verifier_cls", [SequoiaVerifier, TargetSampleVerifier])
def test_exact_on_an_irregular_tree(verifier_cls):
    """Two levels, nodes of one depth under different parents: processed as one batch, each with its own prefix."""
    check_exact("repetition_penalty", "irregular", verifier_cls())


def root_prefix_for_every_node(processors, prefix_ids, tree, logits, nodes=None):
    """A mutant process_tree_scores: every node processed as if it were the root (the bug this file guards)."""
    rows = len(tree) if nodes is None else len(nodes)
    ids = torch.cat([prefix_ids, tree.tokens[:1][None]], dim=1).expand(rows, -1)
    return processors(ids, logits.to(dtype=torch.float32, copy=True))


@pytest.mark.parametrize("verifier_cls", VERIFIERS)
def test_a_mutant_processing_every_node_with_the_roots_prefix_fails(monkeypatch, verifier_cls):
    monkeypatch.setattr(processing, "process_tree_scores", root_prefix_for_every_node)
    for processors, shape, draft in GRID:
        with pytest.raises(AssertionError):
            check_exact(processors, shape, verifier_cls(), draft)
    assert step_error("no_repeat_ngram_size", "chain2", verifier_cls(), "target") > 0.002


class Leaky:
    """A verifier that, with probability 0.002, emits token 0 whatever the target says."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.child_selection = inner, inner.name, inner.child_selection

    def verify(self, tree, target_scores, generator=None, *, source):
        leaked, _ = source.decide(torch.tensor([0.002], dtype=torch.float64), torch.ones(1, dtype=torch.float64))
        if int(leaked) == 0:
            return Verdict(path=[0], bonus_token=0, accepted_ranks=[])
        return self.inner.verify(tree, target_scores, source=source)


@pytest.mark.parametrize("verifier_cls", VERIFIERS)
def test_an_error_of_0_002_is_caught(verifier_cls):
    error = step_error("repetition_penalty", "star3", Leaky(verifier_cls()))
    assert 0.001 < error <= 0.002
    with pytest.raises(AssertionError):
        check_exact("repetition_penalty", "star3", Leaky(verifier_cls()))


def test_node_scores_process_only_the_rows_read_and_equal_the_batch(monkeypatch):
    """What a walking verifier reads (NodeScores, row by row) is bit for bit what process_tree_scores gives the whole
    tree, and nodes never read are never processed."""
    generator = torch.Generator().manual_seed(0)
    tree = TokenTree.from_parents([5, 9, 3, 7, 9, 4, 2], [-1, 0, 0, 1, 1, 2, 4])
    raw = torch.randn(len(tree), 64, generator=generator) * 3
    prefix_ids = torch.randint(3, 64, (1, 6), generator=generator)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7),
                                      TopKLogitsWarper(20), TopPLogitsWarper(0.9)])
    batch = processing.process_tree_scores(processors, prefix_ids, tree, raw)
    lazy = processing.NodeScores(processors, prefix_ids, tree, raw)
    calls, real = [], processing.process_tree_scores
    monkeypatch.setattr(processing, "process_tree_scores", lambda *args: calls.append(args[4]) or real(*args))
    assert torch.equal(lazy[4], batch[4]) and torch.equal(lazy[[0, 1, 4]], batch[[0, 1, 4]])
    assert torch.equal(lazy[4], batch[4])
    assert calls == [[4], [0], [1]]  # each row read is processed once; the other four never


# --------------------------------------------------------------------------- ties at the top-p cut, target side


class TiedCutCase(ProcessedCase):
    """Integer logits (-2..2) over 32 tokens, top-k 4 then top-p 0.6: ties straddle the top-p cut often, and which tied
    token survives is decided by Transformers' sort (not stable beyond 16 columns), not by column order. The draft
    proposes from 3 tokens (its own top-3), so the enumeration stays small."""

    def raw(self, prefix: tuple[int, ...]) -> torch.Tensor:
        return torch.round(toy_logits(self.seed, prefix, self.vocab, 0.0, temperature=2.0))

    def draft_q(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if self.same:  # the draft proposes the target's own tokens: the walk goes below the root
            return super().draft_q(prefix)
        logits = toy_logits(self.seed + 1000, prefix, self.vocab, 0.0, temperature=1.3)
        return TopKLogitsWarper(3)(None, logits[None])[0].softmax(-1)


def tied_processors() -> LogitsProcessorList:
    return LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(4), TopPLogitsWarper(0.6)])


def raw_tree(case: ProcessedCase, nested) -> tuple:
    """The drafted tree and the raw logits of its nodes (the verifier below processes them as the loop does)."""
    tree, _ = to_token_tree(case, nested)
    tokens = tree.tokens.tolist()
    return tree, torch.stack([case.raw(case.prompt + tuple(tokens[i] for i in tree.path_to(n)[1:]))
                              for n in range(len(tree))])


class OnNodeScores:
    """The verifier as the loop runs it: a fresh NodeScores over the raw logits per run (narrowed rows, flagged).
    `columns=False` turns off the top-k columns path (`NodeScores.top_at`), so that every decision
    reads vocabulary-wide rows narrowed by `narrowed.apply_narrowed` first."""

    def __init__(self, inner, case: ProcessedCase, columns: bool = True) -> None:
        self.inner, self.case, self.flagged, self.columns = inner, case, [], columns
        self.name, self.child_selection = inner.name, inner.child_selection

    def verify(self, tree, raw, generator=None, *, source):
        scores = processing.NodeScores(self.case.processors, torch.tensor([self.case.prompt[:-1]]), tree, raw)
        if not self.columns:
            scores.split = None
        row_at, top_at = scores.row_at, scores.top_at

        def counted(node, walked, narrow):  # the device walk reads its flags itself: count the raised ones
            row, flag = row_at(node, walked, narrow)
            self.flagged.append(flag is not None and bool(flag))
            return row, flag

        def counted_top(node, walked):
            top = top_at(node, walked)
            self.flagged.append(top is not None and bool(top[2]))
            return top

        scores.row_at, scores.top_at = counted, counted_top
        return self.inner.verify(tree, scores, source=source)


def tied_error(verifier_cls, shape: str, seed: int = 23, columns: bool = False) -> tuple[float, int]:
    """Seed 23: every row flagged, the root's included; 36: the root's row not, its children's all, and the draft
    is the target (its children are the target's likeliest tokens). `columns`: see `OnNodeScores`."""
    case = TiedCutCase(seed, 32, tied_processors(), prompt=(1, 2, 1), same=seed == 36)
    verifier = OnNodeScores(verifier_cls(), case, columns)
    length = depth(SHAPES[shape]) + 1
    got, _ = speculative_joint(case, SHAPES[shape], verifier, length, build=raw_tree)
    assert abs(sum(got.values()) - 1) < 1e-9
    return total_variation(got, target_joint(case, case.prompt, length)), sum(verifier.flagged)


TIED_VERIFIERS = WIDE_VOCABULARY_WALKS


@pytest.mark.parametrize("verifier_cls", TIED_VERIFIERS)
@pytest.mark.parametrize("shape", ["chain2", "star3"])
@pytest.mark.parametrize("columns", [False, True])
def test_exact_when_ties_straddle_the_top_p_cut(verifier_cls, shape, columns):
    """The target's rows are narrowed (vocabulary-wide, or as top-k columns), flagged rows decided again on
    Transformers' rows: exact, and the flags did fire."""
    error, flagged = tied_error(verifier_cls, shape, columns=columns)
    assert error < TOLERANCE and flagged > 0


@pytest.mark.parametrize("verifier_cls,shape", [*((cls, "chain2") for cls in WIDE_VOCABULARY_WALKS),
                                                *((cls, "widths22") for cls in TARGET_SAMPLING)])
def test_exact_when_only_rows_below_the_root_are_flagged(verifier_cls, shape):
    """The walk meets a flagged row only on some paths: that level is decided again, the ones above it stand."""
    error, flagged = tied_error(verifier_cls, shape, seed=36)
    assert error < TOLERANCE and flagged > 0


@pytest.mark.parametrize("verifier_cls", TIED_VERIFIERS)
def test_ignoring_the_flags_is_caught(monkeypatch, verifier_cls):
    """Flags never raised: the narrowed rows' tie order (lowest ids dropped) decides, not Transformers' sort."""
    apply = processing.apply_narrowed
    monkeypatch.setattr(processing, "apply_narrowed", lambda *args: (apply(*args)[0], torch.zeros(1, dtype=bool)))
    error, _ = tied_error(verifier_cls, "chain2")
    assert error > 1e-3


@pytest.mark.parametrize("verifier_cls", TARGET_SAMPLING)
def test_a_walk_restarted_from_the_root_on_a_flag_is_caught(monkeypatch, verifier_cls):
    """Whether a level is flagged depends on the draws above it: dropping those draws too (a restart) biases the walk
    towards the paths that meet no flagged row. Only the flagged level and what follows may be decided again."""
    def restart(self, scores, source, stop_early):
        exact = set(range(self.levels))  # the mutant: every level exact, from the root again
        for narrow in (True, False):
            states = [self.start]
            for _ in range(self.levels):
                after, flag = self._level(scores, source, states[-1], len(states) - 1, narrow=narrow)
                flagged = bool(flag & states[-1].alive) if flag is not None else False
                states.append(after)
                if flagged:
                    break
            else:
                alive, end, bonus = (int(t) for t in (states[-1].alive, states[-1].end, states[-1].bonus))
                return self._verdict(end, bonus, states, scores)
        raise AssertionError(exact)

    monkeypatch.setattr(walk.Walk, "run", restart)
    error, _ = tied_error(verifier_cls, "chain2", seed=36)
    assert error > 1e-3
