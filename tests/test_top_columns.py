"""Rows as their top-k columns (issue 21e): when the processors end with a -inf top-k (then temperature, or top-p on
the draft side), a sampled step works on the k columns a row can have mass on, never a vocabulary-wide row again.

- Target side (`NodeScores.top_at`, `narrowed.exact_top_columns`): the columns and values are
  Transformers' processed row bit for bit, and a row where they may not be (a finite score tied with the k-th:
  Transformers keeps every tied column, a top-k keeps k; NaN, +inf) is flagged and decided again on Transformers'
  row.
- Draft side (`draft_top_scores`): the children are drawn from the k columns, and the tree hands the verifier that
  very distribution (`draft_probs`, zero outside `draft_columns`), over steps that reuse one buffer.
- The residual verifiers then run their trials on the union of the target's and the draft's columns: exact, checked
  by enumeration as in tests/test_sampling_exact.py, ties at the top-k cut included.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    Qwen2Config,
    Qwen2ForCausalLM,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_specdec import TokenTree
from hf_specdec.draft.shaped_tree import ModelTreeDrafter
from hf_specdec.logits import narrowed, processing
from hf_specdec.verify import SequoiaVerifier, SpecInferVerifier, walk
from tests.helpers.exactness import (
    SHAPES,
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


# --------------------------------------------------------------------------- target side: Transformers' rows


def _dense(values: torch.Tensor, columns: torch.Tensor, width: int) -> torch.Tensor:
    return torch.full((len(values), width), -float("inf")).scatter(1, columns, values)


def exact_columns(processors: LogitsProcessorList, ids: torch.Tensor, rows: torch.Tensor):
    """`narrowed.exact_top_columns` as `NodeScores` calls it: a head of temperatures runs after the top-k."""
    head, k, tail = narrowed.exact_top_split(processors)
    if narrowed.deferred(head):
        return narrowed.exact_top_columns(k, head, tail, ids, rows)
    return narrowed.exact_top_columns(k, LogitsProcessorList(), tail, ids, head(ids, rows.float()))


@pytest.mark.parametrize("width", [7, 50, 3_000])
@pytest.mark.parametrize("top_k", [1, 5, 40])
@pytest.mark.parametrize("head", ["temperature", "penalty", "none"])
@pytest.mark.parametrize("kind", ["random", "tie_at_kth", "ties_past_the_room", "integers", "banned", "bfloat16"])
@pytest.mark.parametrize("top_p", [None, 0.9, 0.5])
def test_target_top_columns_are_transformers_rows_bit_for_bit(width, top_k, head, kind, top_p):
    """Every row not flagged is Transformers' processed row bit for bit (as columns), the columns tied with the k-th
    included; a row whose ties with the k-th go past `TIE_ROOM` is flagged. bfloat16 rows (a half-precision target's
    logits) are compared with Transformers' processors on their float32 conversion, as the loop hands them. A top-p
    after the top-k (with the temperature on either side of it) cuts where Transformers' does."""
    generator = torch.Generator().manual_seed(width * 1000 + top_k)
    rows = torch.randn(6, width, generator=generator) * 3
    if kind == "integers":
        rows = rows.round()
    elif kind == "tie_at_kth" and width > top_k:
        order = rows.argsort(-1, descending=True)
        for r in range(len(rows)):
            rows[r, order[r, top_k]] = rows[r, order[r, top_k - 1]]  # the (k+1)-th ties with the k-th
    elif kind == "ties_past_the_room" and width > top_k + narrowed.TIE_ROOM:
        order = rows.argsort(-1, descending=True)
        for r in range(len(rows)):  # every column read past the k-th ties with it, and one more
            rows[r, order[r, top_k : top_k + narrowed.TIE_ROOM + 1]] = float(rows[r, order[r, top_k - 1]])
    elif kind == "banned":
        rows[:, : width - max(1, top_k // 2)] = -float("inf")  # fewer finite scores than k
    elif kind == "bfloat16":
        rows = rows.bfloat16()  # many ties among 3,000 columns: some at the k-th
    heads = {"temperature": [TemperatureLogitsWarper(0.7)], "penalty": [RepetitionPenaltyLogitsProcessor(1.3)],
             "none": []}
    tail = [TemperatureLogitsWarper(0.9)]
    if top_p is not None:
        tail = [TopPLogitsWarper(top_p), *tail] if top_p < 0.7 else [*tail, TopPLogitsWarper(top_p)]
    processors = LogitsProcessorList([*heads[head], TopKLogitsWarper(top_k), *tail])
    ids = torch.randint(0, width, (len(rows), 5), generator=generator)
    expected = processors(ids, rows.float())
    values, columns, unsure = exact_columns(processors, ids, rows.clone())
    got = _dense(values, columns, width)
    for r in range(len(rows)):
        if not unsure[r]:
            assert torch.equal(got[r], expected[r])
    tied = head != "penalty"  # a penalty may part the tied columns
    if kind == "tie_at_kth" and width > top_k and tied and top_p is None:
        assert (expected > -float("inf")).sum(-1).gt(top_k).all()  # Transformers keeps the tie: so do the columns
        assert not bool(unsure.any())
    if kind == "ties_past_the_room" and width > top_k + narrowed.TIE_ROOM and tied:
        assert bool(unsure.all())
    if kind == "random":
        assert not bool(unsure.any())


def test_a_temperature_creating_a_tie_at_the_cut_is_kept():
    """Two scores one float32 step apart, equal once divided by the temperature: Transformers' top-k (after the
    temperature) keeps both; the top-k over the raw row, with the temperature deferred, keeps both too."""
    temperature = 1.5  # scores in [1.5, 2) land in [1, 1.33), where float32 steps are 1.5 times coarser
    lows = 1.5 + 0.0003 * torch.arange(1000, dtype=torch.float32)
    highs = torch.nextafter(lows, torch.tensor(2.0))
    low, high = next((lo, hi) for lo, hi in zip(lows, highs) if bool(hi / temperature == lo / temperature))
    rows = torch.stack([torch.tensor(5.0), high, low, torch.tensor(-3.0)])[None]
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(2)])
    expected = processors(None, rows.clone())
    assert int((expected > -float("inf")).sum()) == 3
    values, columns, unsure = exact_columns(processors, None, rows)
    assert not bool(unsure[0]) and torch.equal(_dense(values, columns, 4), expected)


def test_target_rows_with_nan_or_inf_are_flagged():
    rows = torch.randn(3, 30)
    rows[0, 4], rows[1, 7] = float("nan"), float("inf")
    _, _, unsure = exact_columns(LogitsProcessorList([TopKLogitsWarper(5)]), None, rows)
    assert unsure.tolist() == [True, True, False]


def test_only_a_top_k_then_temperature_or_top_p_takes_the_exact_path():
    with_p = LogitsProcessorList([TopKLogitsWarper(5), TopPLogitsWarper(0.9)])
    assert narrowed.exact_top_split(with_p) is not None
    assert narrowed.exact_top_split(LogitsProcessorList([TemperatureLogitsWarper(0.5)])) is None
    assert narrowed.exact_top_split(LogitsProcessorList([TopKLogitsWarper(5), TopPLogitsWarper(0.9, -1e4)])) is None
    after = LogitsProcessorList([TopKLogitsWarper(5), RepetitionPenaltyLogitsProcessor(1.2)])
    assert narrowed.topk_split(after) is None


def _near_cut_row(top_p: float) -> torch.Tensor:
    """Three scores whose two smallest probabilities sum to 1 - top_p within a float32 step."""
    threshold = 1 - top_p
    probs = torch.tensor([1 - threshold, threshold / 2, threshold / 2], dtype=torch.float64)
    return torch.cat([probs.log().float(), torch.full((7,), -30.0)])[None]


def test_a_top_p_cumulative_sum_at_its_cut_is_flagged():
    """Where a cumulative sum lies within rounding of 1 - top_p, summing the k terms in the row's order instead of
    Transformers' could move the cut by one column: the row is flagged. Moved slightly away, it is not."""
    processors = LogitsProcessorList([TopKLogitsWarper(3), TopPLogitsWarper(0.8)])
    rows = _near_cut_row(0.8)
    _, _, unsure = exact_columns(processors, None, rows.clone())
    assert bool(unsure[0])
    rows[0, 1] -= 0.01  # the two smallest now sum to a little under 0.2: removed, clearly
    values, columns, unsure = exact_columns(processors, None, rows.clone())
    assert not bool(unsure[0])
    assert torch.equal(_dense(values, columns, 10), processors(None, rows.clone()))


@pytest.mark.parametrize("width", [4, 32, 3_000])
def test_a_tie_straddling_a_top_p_cut_is_flagged(width):
    """Two equal scores, one removed by top-p and one kept: which goes is the sort's order of ties, which on this
    CPU changes with the row's width (at width 4 Transformers keeps the later column, the top-k the earlier)."""
    rows = torch.full((1, width), -9.0)
    rows[0, :3] = torch.tensor([2.0, 0.0, 0.0])  # top-3 probabilities, ascending: 0.107, 0.107, 0.787
    processors = LogitsProcessorList([TopKLogitsWarper(3), TopPLogitsWarper(0.85)])
    assert int((processors(None, rows.clone()) > -float("inf")).sum()) == 2  # Transformers removes one of the two
    _, _, unsure = exact_columns(processors, None, rows.clone())
    assert bool(unsure[0])


def test_node_scores_top_at_matches_its_rows():
    """`NodeScores.top_at` at nodes of several depths (each with its own prefix) is `NodeScores[node]`."""
    generator = torch.Generator().manual_seed(3)
    tree = TokenTree.from_parents([5, 9, 3, 7, 9, 4, 2], [-1, 0, 0, 1, 1, 2, 4])
    raw = torch.randn(len(tree), 64, generator=generator) * 3
    prefix_ids = torch.randint(3, 64, (1, 6), generator=generator)
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7),
                                      TopKLogitsWarper(20)])
    scores = processing.NodeScores(processors, prefix_ids, tree, raw)
    fresh = processing.NodeScores(processors, prefix_ids, tree, raw)
    for node in [4, 0, 1, 6]:
        value, column, flag = scores.top_at(torch.tensor([node]), tree.tokens[tree.path_to(node)])
        assert torch.equal(_dense(value[None], column[None], 64)[0], fresh[node]) and not bool(flag)


# --------------------------------------------------------------------------- exact by enumeration


class TiedTopKCase(ProcessedCase):
    """Integer logits (-2..2) over 32 tokens, temperature then top-k 4: ties at the k-th value are frequent, and the
    target then keeps every tied column. The draft proposes from its own top-3 (or is the processed target)."""

    tied = True  # False: float logits, no ties at the cut (every decision on the top-k columns)

    def raw(self, prefix: tuple[int, ...]) -> torch.Tensor:
        logits = toy_logits(self.seed, prefix, self.vocab, 0.0, temperature=2.0)
        return torch.round(logits) if self.tied else logits

    def draft_q(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if self.same:
            return super().draft_q(prefix)
        logits = toy_logits(self.seed + 1000, prefix, self.vocab, 0.0, temperature=1.3)
        return TopKLogitsWarper(3)(None, logits[None])[0].softmax(-1)


def columns_tree(case: ProcessedCase, nested) -> tuple:
    """The drafted tree with `draft_columns` (each row's columns with mass, as a drafter sampling after a top-k
    gives them), and the raw logits of its nodes."""
    tree, _ = to_token_tree(case, nested)
    q = tree.draft_probs
    width = int((q > 0).sum(-1).max())
    columns = torch.sort(q, dim=-1, descending=True, stable=True).indices[:, :width]
    assert not bool(q.scatter(1, columns, 0.0).any())  # zero outside its columns
    tree = TokenTree.from_parents(tree.tokens.tolist(), tree.parents.tolist(), draft_probs=q, draft_columns=columns)
    tokens = tree.tokens.tolist()
    raw = torch.stack([case.raw(case.prompt + tuple(tokens[i] for i in tree.path_to(n)[1:]))
                       for n in range(len(tree))])
    return tree, raw


class OnTopColumns:
    """The verifier as the loop runs it, counting the top-k decisions taken and the flags read with them."""

    def __init__(self, inner, case: ProcessedCase) -> None:
        self.inner, self.case, self.voided, self.top_calls = inner, case, [], 0
        self.name, self.child_selection = inner.name, inner.child_selection

    def verify(self, tree, raw, generator=None, *, source):
        scores = processing.NodeScores(self.case.processors, torch.tensor([self.case.prompt[:-1]]), tree, raw)
        top_at = scores.top_at

        def at(node, walked):
            self.top_calls += 1
            value, column, flag = top_at(node, walked)
            if bool(flag):  # the walk reads its flags itself: count the raised ones here
                self.voided.append(1)
            return value, column, flag

        scores.top_at = at
        return self.inner.verify(tree, scores, source=source)


def top_k_error(verifier_cls, shape: str, seed: int, same: bool, tied: bool = True,
                top_p: float | None = None) -> tuple[float, int, int]:
    top_p_warper = [] if top_p is None else [TopPLogitsWarper(top_p)]
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(4), *top_p_warper])
    case = TiedTopKCase(seed, 32, processors, prompt=(1, 2, 1), same=same)
    case.tied = tied
    verifier = OnTopColumns(verifier_cls(), case)
    length = depth(SHAPES[shape]) + 1
    got, _ = speculative_joint(case, SHAPES[shape], verifier, length, build=columns_tree)
    assert abs(sum(got.values()) - 1) < 1e-9
    return total_variation(got, target_joint(case, case.prompt, length)), len(verifier.voided), verifier.top_calls


VERIFIERS = WIDE_VOCABULARY_WALKS


# the draft = the tied target, walked on the device (every level drawn, flagged levels redrawn): a slow enumeration
EXACT_CASES = [(verifier_cls, shape, *case) for verifier_cls in VERIFIERS for shape in ("chain2", "star3")
               for case in ((23, False, True), (36, True, True), (5, False, False))
               if not (verifier_cls.stop_early is False and case[1])]


@pytest.mark.parametrize("verifier_cls,shape,seed,same,tied", EXACT_CASES)
def test_exact_on_top_columns(verifier_cls, shape, seed, same, tied):
    """Ties at the cut (rows flagged, decided on Transformers' rows) or none (every decision on the columns)."""
    error, _, calls = top_k_error(verifier_cls, shape, seed, same, tied)
    assert error < TOLERANCE and calls > 0


@pytest.mark.parametrize("verifier_cls", VERIFIERS)
def test_the_flags_fire_and_ignoring_them_is_caught(monkeypatch, verifier_cls):
    """Ties at the k-th value past the room read (one column here, so that the integer rows' ties overflow it):
    flagged rows decided on Transformers' rows. A mutant that never flags keeps the tied columns read where
    Transformers keeps all: caught."""
    monkeypatch.setattr(narrowed, "TIE_ROOM", 1)
    _, flagged, _ = top_k_error(verifier_cls, "chain2", 23, False)
    assert flagged > 0
    exact = narrowed.exact_top_columns

    def unflagged(*args):
        values, columns, unsure = exact(*args)
        return values, columns, torch.zeros_like(unsure)

    monkeypatch.setattr(processing, "exact_top_columns", unflagged)
    error, _, _ = top_k_error(verifier_cls, "chain2", 23, False)
    assert error > 1e-3


@pytest.mark.parametrize("verifier_cls", VERIFIERS)
@pytest.mark.parametrize("tied", [True, False])
def test_exact_on_top_columns_after_top_p(verifier_cls, tied):
    """Temperature, top-k 4, top-p 0.8: the target's rows cut by top-p on their k columns; integer logits make
    ties straddling the cut frequent (flagged, decided on Transformers' rows)."""
    error, _, calls = top_k_error(verifier_cls, "star3", 23, False, tied, top_p=0.8)
    assert error < TOLERANCE and calls > 0


@pytest.mark.parametrize("verifier_cls", [SequoiaVerifier, SpecInferVerifier])
def test_a_union_counting_shared_columns_twice_is_caught(monkeypatch, verifier_cls):
    """The draft's columns the target's row also has are counted once (in the target's part): a mutant union that
    keeps them twice doubles their draft mass."""
    real = walk.ResidualWalk.__init__

    def twice(self, tree, device, without_replacement):
        if tree.draft_columns is not None:  # the draft's columns repeated: the mutant sees them in both parts
            tree = TokenTree.from_parents(tree.tokens.tolist(), tree.parents.tolist(), draft_probs=tree.draft_probs,
                                          draft_columns=torch.cat([tree.draft_columns, tree.draft_columns], 1))
        real(self, tree, device, without_replacement)

    error, flagged, _ = top_k_error(verifier_cls, "star3", 5, False, tied=False)
    assert error < TOLERANCE and flagged == 0  # no ties: every decision on the columns
    monkeypatch.setattr(walk.ResidualWalk, "__init__", twice)
    error, _, _ = top_k_error(verifier_cls, "star3", 5, False, tied=False)
    assert error > 1e-3


# --------------------------------------------------------------------------- draft side


def tiny_draft(vocab: int = 96) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.mark.parametrize("tail", [[], [TopPLogitsWarper(0.8)]])
def test_draft_rows_are_the_top_columns_they_were_drawn_from(tail):
    """Over steps that reuse the drafter's buffer: each parent's `draft_probs` row is a distribution on its
    `draft_columns` (zero elsewhere, nothing left from an earlier step) equal to the softmax of the draft's
    processed scores there, and its children are drawn among those columns."""
    model = tiny_draft()
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(6), *tail])
    generator = torch.Generator().manual_seed(1)
    drafter = ModelTreeDrafter(model, [-1, 0, 0, 1, 1, 2], processors, "without_replacement", generator)
    for step in range(4):
        ids = torch.randint(3, 96, (1, 5 + step), generator=torch.Generator().manual_seed(step))
        tree = drafter.propose(ids)
        assert tree.draft_columns is not None
        host = tree.host(tokens=True)
        children = host.children()
        for node in range(len(tree)):
            if not children[node]:
                continue
            row, columns = tree.draft_probs[node], tree.draft_columns[node]
            assert abs(float(row.sum()) - 1) < 1e-5
            outside = row.clone().index_fill_(0, columns, 0)
            assert not bool(outside.any())
            assert all(host.tokens[c] in columns.tolist() and float(row[host.tokens[c]]) > 0 for c in children[node])
            sequence = torch.tensor([ids[0].tolist() + [host.tokens[a] for a in tree.path_to(node)[1:]]])
            with torch.no_grad():
                expected = processors(sequence, model(sequence).logits[0, -1:].float())[0].softmax(-1)
            assert torch.allclose(row, expected, atol=1e-5)
