"""Top-p after top-k in linear time (`logits/narrowed.py`) against Transformers' own processors on random rows.

The claim: bit-identical to Transformers whenever its sort puts equal scores in column order (a stable sort), on
every row (ties at the k-th value, at the top-p cut, -inf present, bfloat16-rounded scores, temperature before and
after, min_tokens_to_keep); with the default (unstable) CPU sort, only which of the columns tied at the cut survive
may differ, never their number or the other columns, and every such row is flagged. The draft side takes the narrowed
rows as they are; the target side (`NodeScores.row_at`) flags the rows it must send back to Transformers' path, so what
it settles on is Transformers' own rows, bit for bit, with the default sort.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_specdec  # noqa: F401  (installs `speculation=`)
from hf_specdec import SpecExecConfig, TokenTree, TreeConfig
from hf_specdec.logits import narrowed
from hf_specdec.logits.processing import NodeScores, process_tree_scores
from tests.tiny import tiny_model

_SORT = torch.sort


def _stable_sort(*args, **kwargs):
    return _SORT(*args, **{**kwargs, "stable": True})


def _rows(kind: str, n: int, width: int, generator: torch.Generator) -> torch.Tensor:
    rows = torch.randn(n, width, generator=generator) * 3
    if kind == "ties":  # a handful of distinct values: ties at the k-th value and at the cut
        rows = torch.randint(0, 6, (n, width), generator=generator).float()
    elif kind == "bfloat16":  # a bfloat16 model's logits: ties among the top scores
        rows = (rows * 4).to(torch.bfloat16).float()
    elif kind == "infinite":  # -inf already present, sometimes fewer finite columns than k
        rows[torch.rand(n, width, generator=generator) < 0.97] = -float("inf")
    return rows


def _random_processors(generator: torch.Generator, width: int) -> LogitsProcessorList:
    def draw(high: int) -> int:
        return int(torch.randint(1, high, (1,), generator=generator))

    keep = draw(4)
    processors = [TemperatureLogitsWarper(0.7)] if draw(3) == 1 else []
    processors += [TopKLogitsWarper(draw(min(width, 90) + 8), min_tokens_to_keep=keep)]
    processors += [TemperatureLogitsWarper(1.3)] if draw(3) == 1 else []
    processors += [TopPLogitsWarper(float(torch.rand(1, generator=generator)), min_tokens_to_keep=keep)]
    return LogitsProcessorList(processors)


def _cases(seed: int):
    generator = torch.Generator().manual_seed(seed)
    for trial in range(96):
        width = (151_936, 2_000, 41)[trial % 3]
        kind = ("gaussian", "ties", "bfloat16", "infinite")[trial // 3 % 4]
        yield _random_processors(generator, width), _rows(kind, 6, width, generator)


def _narrowed(processors: LogitsProcessorList, rows: torch.Tensor) -> torch.Tensor:
    plan = narrowed.narrowed_plan(processors)
    assert plan is not None
    return narrowed.apply_narrowed(plan, torch.zeros(len(rows), 2, dtype=torch.long), rows.clone())[0]


def test_bit_identical_to_transformers_with_ties_in_column_order():
    for processors, rows in _cases(0):
        ids = torch.zeros(len(rows), 2, dtype=torch.long)
        with mock.patch("torch.sort", _stable_sort):
            expected = processors(ids, rows.clone())
        assert torch.equal(_narrowed(processors, rows), expected), processors


def test_top_p_cut_exactly_at_a_cumulative_probability():
    """top_p chosen so that `1 - top_p` equals a cumulative probability: the `<=` decides at equality."""
    generator = torch.Generator().manual_seed(1)
    for trial in range(60):
        rows = _rows(("gaussian", "ties", "bfloat16")[trial % 3], 1, 5_000, generator)
        top_k = TopKLogitsWarper(40)
        filtered = top_k(None, rows)
        cumulative = _SORT(filtered).values.softmax(-1).cumsum(-1)[0]
        at = int(torch.randint(5_000 - 40, 5_000 - 1, (1,), generator=generator))
        processors = LogitsProcessorList([top_k, TopPLogitsWarper(1 - float(cumulative[at]))])
        with mock.patch("torch.sort", _stable_sort):
            expected = processors(None, rows.clone())
        assert torch.equal(_narrowed(processors, rows), expected)


def test_with_transformers_default_sort_only_the_tied_columns_at_the_cut_may_differ():
    differing = 0
    for processors, rows in _cases(2):
        expected = processors(torch.zeros(len(rows), 2, dtype=torch.long), rows.clone())
        got, unsure = narrowed.apply_narrowed(narrowed.narrowed_plan(processors), None, rows.clone())
        for mine, theirs, flagged in zip(got, expected, unsure):
            kept, their_kept = mine > -float("inf"), theirs > -float("inf")
            assert kept.sum() == their_kept.sum()
            assert torch.equal(mine[kept & their_kept], theirs[kept & their_kept])
            moved = kept ^ their_kept
            if moved.any():  # same count kept: the moved columns all hold the cut's score, in both
                differing += 1
                assert flagged  # the target side never keeps such a row
                cut = theirs[their_kept].min()
                assert mine[kept].min() == cut
                assert (mine[moved & kept] == cut).all() and (theirs[moved & their_kept] == cut).all()
    assert differing > 0  # the tie rows really straddle the cut sometimes: the comparison above is not vacuous


def _constructed(kind: str, rows: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """Rows with a tie made where it matters: at the k-th value, or across the top-p cut (the last removed column
    given the first kept one's score), or a signed zero next to a zero."""
    rows = rows.clone()
    for row in rows:
        order = _SORT(row, stable=True).indices  # ascending
        finite = int(torch.isfinite(row).sum())
        if kind == "tie_at_kth" and finite > top_k:
            row[order[-1 - int(torch.randint(top_k, finite, (1,), generator=generator))]] = row[order[-top_k]]
        elif kind == "tie_at_cut":
            filtered = TopKLogitsWarper(top_k)(None, row[None])[0]
            ascending = _SORT(filtered, stable=True)
            removed = int((ascending.values.softmax(-1).cumsum(-1) <= 1 - top_p).sum().clamp(max=len(row) - 1))
            if removed > 0:
                row[ascending.indices[removed - 1]] = ascending.values[removed]
        elif kind == "signed_zero":
            row[order[-1]], row[order[-2]] = 0.0, -0.0
    return rows


@settings(max_examples=250, deadline=None)
@given(width=st.sampled_from([41, 300, 2_000, 20_000]), top_k=st.integers(1, 60), keep=st.integers(1, 4),
       keep_p=st.integers(1, 8), top_p=st.floats(0.0, 1.0),
       temperature=st.sampled_from([None, "before", "after", "both"]),
       kind=st.sampled_from(["gaussian", "ties", "bfloat16", "infinite", "tie_at_kth", "tie_at_cut", "signed_zero"]),
       seed=st.integers(0, 2**31 - 1))
def test_target_rows_are_transformers_own_bit_for_bit(width, top_k, keep, keep_p, top_p, temperature, kind, seed):
    """Transformers' default (unstable) sort: every row not flagged is its result bit for bit, and what NodeScores
    settles on (flagged rows recomputed on its path) is its result for every row. Top-p may keep more columns than
    the top-k left (`keep_p`): the cut then falls among the -inf columns."""
    generator = torch.Generator().manual_seed(seed)
    processors = [TemperatureLogitsWarper(0.7)] if temperature in ("before", "both") else []
    processors += [TopKLogitsWarper(top_k, min_tokens_to_keep=keep)]
    processors += [TemperatureLogitsWarper(1.3)] if temperature in ("after", "both") else []
    processors = LogitsProcessorList([*processors, TopPLogitsWarper(top_p, min_tokens_to_keep=keep_p)])
    base = "gaussian" if kind in ("tie_at_kth", "tie_at_cut", "signed_zero") else kind
    rows = _constructed(kind, _rows(base, 4, width, generator), max(top_k, keep), top_p, generator)
    ids = torch.randint(0, width, (4, 3), generator=generator)
    expected = processors(ids, rows.clone())
    got, unsure = narrowed.apply_narrowed(narrowed.narrowed_plan(processors), ids, rows.clone())
    for mine, theirs, flagged in zip(got, expected, unsure):
        assert flagged or torch.equal(mine, theirs)
    for row in range(4):  # one node per row, as a walking verifier reads them
        tree = TokenTree.from_parents([int(ids[row, -1])], [-1])
        scores = NodeScores(processors, ids[row : row + 1, :-1], tree, rows[row : row + 1])
        node, walked = torch.zeros(1, dtype=torch.long), ids[row, -1:]
        narrowed_row, doubt = scores.row_at(node, walked, narrow=True)
        assert doubt is not None and bool(doubt) == bool(unsure[row])
        assert bool(doubt) or torch.equal(narrowed_row, expected[row])
        assert torch.equal(scores.row_at(node, walked, narrow=False)[0], expected[row])
        assert torch.equal(scores[0], expected[row])


def test_flags_are_raised_where_ties_straddle_the_cut():
    """The constructed ties do straddle the cut, and are flagged: the test above is not vacuous."""
    generator = torch.Generator().manual_seed(5)
    processors = LogitsProcessorList([TopKLogitsWarper(40), TopPLogitsWarper(0.7)])
    rows = _constructed("tie_at_cut", _rows("gaussian", 64, 2_000, generator), 40, 0.7, generator)
    _, unsure = narrowed.apply_narrowed(narrowed.narrowed_plan(processors), None, rows)
    assert unsure.float().mean() > 0.5


@pytest.mark.parametrize("processors", [
    [TopKLogitsWarper(5), RepetitionPenaltyLogitsProcessor(1.2), TopPLogitsWarper(0.9)],  # unknown after top-k
    [TopKLogitsWarper(5), MinPLogitsWarper(0.1), TopPLogitsWarper(0.9)],
    [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)],  # no top-k
    [TopKLogitsWarper(5, filter_value=-1e4), TopPLogitsWarper(0.9)],
    [TopKLogitsWarper(5), TopPLogitsWarper(0.9, filter_value=-1e4)],
    [TopKLogitsWarper(5), TemperatureLogitsWarper(0.7)],  # nothing to gain
])
def test_other_lists_take_the_general_path(processors):
    assert narrowed.narrowed_plan(LogitsProcessorList(processors)) is None


def test_any_processor_may_come_before_the_top_k():
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7),
                                      TopKLogitsWarper(20), TopPLogitsWarper(0.8)])
    generator = torch.Generator().manual_seed(3)
    rows = _rows("bfloat16", 4, 3_000, generator)
    ids = torch.randint(0, 3_000, (4, 30), generator=generator)
    with mock.patch("torch.sort", _stable_sort):
        expected = processors(ids, rows.clone())
    plan = narrowed.narrowed_plan(processors)
    assert torch.equal(narrowed.apply_narrowed(plan, ids, rows.clone())[0], expected)


def test_target_side_settles_on_transformers_own_rows():
    """A row whose tie straddles the cut: `process_tree_scores` and a settled NodeScores row are Transformers' own, the
    draft's (any_tie_order) the narrowed one."""
    processors = LogitsProcessorList([TopKLogitsWarper(50), TopPLogitsWarper(0.5)])
    generator = torch.Generator().manual_seed(4)
    tree = TokenTree.from_parents([0], [-1])
    for _ in range(200):
        logits = torch.randint(0, 4, (1, 151_936), generator=generator).float()
        prefix = torch.zeros(1, 2, dtype=torch.long)
        theirs = processors(prefix, logits.clone())
        narrow = _narrowed(processors, logits)
        if not torch.equal(theirs, narrow):
            assert torch.equal(process_tree_scores(processors, prefix, tree, logits), theirs)
            assert torch.equal(process_tree_scores(processors, prefix, tree, logits, any_tie_order=True), narrow)
            scores = NodeScores(processors, prefix, tree, logits)
            node, walked = torch.zeros(1, dtype=torch.long), tree.tokens[:1]
            row, doubt = scores.row_at(node, walked, narrow=True)
            assert torch.equal(row, narrow[0]) and bool(doubt)
            assert torch.equal(scores.row_at(node, walked, narrow=False)[0], theirs[0])
            assert torch.equal(scores[0], theirs[0])  # indexing hands out Transformers' row, never a narrowed one
            return
    pytest.fail("no row straddled the cut")


@pytest.mark.parametrize("config", [TreeConfig(widths=[2, 2]), SpecExecConfig(budget=8)],
                         ids=["tree", "specexec"])
def test_sampled_steps_cut_top_p_on_top_k_columns(config):
    """With top-k then top-p, neither side runs a top-p over vocabulary-wide rows: the drafters cut on their rows'
    k columns (`top_columns`), the target's rows are cut there too (`exact_top_p`; a flagged row would fall back)."""
    target, draft = tiny_model("qwen2", 0), tiny_model("qwen2", 1)
    wide, columns = [], []
    original_wide, original_columns = narrowed.top_p_after_top_k, narrowed.exact_top_p
    with mock.patch.object(narrowed, "top_p_after_top_k", lambda *a: wide.append(1) or original_wide(*a)), \
            mock.patch.object(narrowed, "exact_top_p", lambda *a: columns.append(1) or original_columns(*a)):
        target.generate(torch.tensor([[5, 6, 7, 8]]), assistant_model=draft, speculation=config, max_new_tokens=6,
                        do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    assert columns and not wide
