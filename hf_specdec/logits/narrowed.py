"""Top-p after top-k in linear time: Transformers' `TopPLogitsWarper` sorts the whole vocabulary row, we need not.

After `TopKLogitsWarper` (filter value -inf) a row is -inf outside its top-k columns, plus any columns tied with
the k-th value. Its ascending sort is therefore known without sorting: -inf, then copies of the k-th value, then
the top-k values reversed. Building that array and running Transformers' own arithmetic on it (softmax, cumsum,
`<= 1 - top_p`, the last `min_tokens_to_keep` kept) gives bit-identical cumulative probabilities, hence the same
cut. Only one thing can differ: when columns with equal scores straddle the cut, which of them survive depends on
the sort's order of ties. Here the lowest column ids are removed first, as a stable sort does (CUDA's radix sort
of wide rows, `torch.sort(stable=True)`); the CPU's introsort orders ties arbitrarily. The cut's value and the
number of columns kept are the same either way, so the path is for scores whose exact tie order does not matter:
a draft's proposal distribution (the verifiers use the draft scores the tokens were drawn from, whatever they are).

The target's scores must be Transformers' own, bit for bit: each row also gets a flag, true where its result may
differ (a finite tie straddles a top-p cut, or the row holds NaN or +inf). An unflagged row is Transformers' result
whatever order its sort gives ties: the cut's value and the number removed are fixed by the sorted values, and with
no tie across the cut the removed columns are exactly those below the cut. Flagged rows go back to Transformers'
path (`processing.NodeScores`).

Where nothing but temperature (and, for a draft, top-p) follows the -inf top-k, a row is -inf outside k columns, and
a sampled step need never touch the rest: `top_columns` (a draft's rows: its children are drawn from these columns,
and the tree hands the verifier that very distribution) and `exact_top_columns` (the target's: Transformers' kept
columns and values bit for bit, the columns tied with the k-th included up to `TIE_ROOM` of them; flagged where
the ties may go on, or where a top-p's cumulative sum comes within rounding of its cut) give the columns after one
top-k over the row.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .wide_rows import row_topk

# After a top-k, these may follow: temperature keeps -inf at -inf and is elementwise; top-p is replaced below.
_TAIL = (TemperatureLogitsWarper, TopPLogitsWarper)


def topk_split(processors: LogitsProcessorList) -> tuple[LogitsProcessorList, int, LogitsProcessorList] | None:
    """`(head, k, tail)` where the list is head, then a -inf top-k keeping k (not in head), then temperature/top-p only
    (top-p with a -inf filter value): after it, a row is -inf outside its top-k columns (and the columns tied with
    the k-th value). None where the list has no such top-k."""
    last = max((i for i, p in enumerate(processors) if type(p) is TopKLogitsWarper), default=None)
    if last is None or processors[last].filter_value != -float("inf"):
        return None
    tail = LogitsProcessorList(processors[last + 1 :])
    if not all(type(p) in _TAIL for p in tail):
        return None
    if any(type(p) is TopPLogitsWarper and p.filter_value != -float("inf") for p in tail):
        return None
    return LogitsProcessorList(processors[:last]), processors[last].top_k, tail


def narrowed_plan(processors: LogitsProcessorList) -> tuple[LogitsProcessorList, int, LogitsProcessorList] | None:
    """`(head, k, tail)` where the list is head (ending with a -inf top-k keeping k) then temperature/top-p only.

    None where nothing can be narrowed: no such top-k, a top-p or top-k with another filter value, any other
    processor after the top-k (its effect on -inf columns is unknown), or no top-p to gain from.
    """
    split = topk_split(processors)
    if split is None or not any(type(p) is TopPLogitsWarper for p in split[2]):
        return None
    head, k, tail = split
    return LogitsProcessorList([*head, processors[len(head)]]), k, tail


def deferred(head: LogitsProcessorList) -> bool:
    """Whether the processors before a top-k can run after it, on its k columns: temperatures only (elementwise
    and increasing, so the top-k columns are the same, but for ties a temperature's rounding creates)."""
    return all(type(p) is TemperatureLogitsWarper for p in head)


def top_columns(k: int, late: LogitsProcessorList, ids: torch.Tensor,
                scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft's processed rows as their k best columns: `(values, columns)`, each `(n, k)`, values in descending
    order (-inf where a row has fewer than k finite scores, or top-p removed the column); every other column of the
    row is -inf. `scores` (any float dtype) have been through the processors before the top-k, but those in `late`:
    a deferred head's temperatures (`deferred`), then the processors after the top-k, which run on the k columns.

    One linear pass over the vocabulary (the top-k) instead of Transformers' temperature, top-k, top-p sort, softmax
    and a sampling draw over every column. Not Transformers' rows bit for bit, so for a draft's proposal only (its
    tokens are drawn from these rows, and the verifier is handed them): where columns tie with the k-th value,
    Transformers keeps them all and this keeps k; top-p runs on the k columns (the -inf ones add nothing).
    """
    values, columns = row_topk(scores, min(k, scores.shape[-1]))
    values = values.float()
    for processor in late:
        if type(processor) is TopPLogitsWarper:
            remove = values.flip(-1).softmax(-1).cumsum(-1) <= (1 - processor.top_p)  # ascending, as Transformers
            remove[..., -processor.min_tokens_to_keep :] = False
            values = values.masked_fill(remove.flip(-1), -float("inf"))
        else:
            values = processor(ids, values)  # temperature: elementwise
    return values, columns


def apply_narrowed(plan: tuple[LogitsProcessorList, int, LogitsProcessorList], ids: torch.Tensor,
                   scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The processors of `narrowed_plan`, with each top-p computed by `top_p_after_top_k`; and `(n,)` flags, true
    for the rows that may differ from Transformers' result (see `top_p_after_top_k`)."""
    head, k, tail = plan
    scores = head(ids, scores)
    unsure = torch.zeros(len(scores), dtype=torch.bool, device=scores.device)
    for processor in tail:
        if type(processor) is TopPLogitsWarper:
            scores, flags = top_p_after_top_k(scores, k, processor.top_p, processor.min_tokens_to_keep)
            unsure |= flags
        else:
            scores = processor(ids, scores)
    return scores, unsure


def top_p_after_top_k(scores: torch.Tensor, top_k: int, top_p: float,
                      min_tokens_to_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`TopPLogitsWarper(top_p, min_tokens_to_keep=...)` on `(n, V)` rows that a -inf top-k of `top_k` has filtered;
    and `(n,)` flags: true where the result may not be Transformers' (a finite tie straddles the cut, NaN or +inf).

    Every op is linear in V and stays on the rows' device; ties straddling the cut lose their lowest column ids.
    Rows where fewer than k columns are finite (-inf ties at the k-th place) are handled by the same formulas.
    """
    width = scores.shape[-1]
    k = min(top_k, width)
    top = row_topk(scores, k)[0]  # descending; the k-th is the smallest finite score (or -inf)
    kth = top[:, -1:]
    kept = (scores >= kth).sum(-1, keepdim=True)  # columns top-k left (ties at the k-th value included)
    position = torch.arange(width, device=scores.device)
    ascending = torch.where(position >= width - kept, kth, torch.full_like(kth, -float("inf")))
    ascending[:, width - k :] = top.flip(-1)  # = torch.sort(scores).values, built in linear time
    remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)  # Transformers' expression, same bits
    remove[..., -min_tokens_to_keep:] = False
    removed = remove.sum(-1, keepdim=True)  # the cumulative sum only grows: the removed positions are a prefix
    cut = ascending.gather(-1, removed.clamp(max=width - 1))  # the smallest surviving score
    last_removed = ascending.gather(-1, (removed - 1).clamp(min=0))
    straddles = (removed > 0) & (last_removed == cut) & (cut > -float("inf"))  # -inf ties: filling -inf changes nothing
    unsure = straddles[:, 0] | top[:, 0].isnan() | top[:, 0].isposinf()  # topk ranks NaN first
    below = scores < cut
    tied = scores == cut
    tie_rank = tied.cumsum(-1, dtype=torch.int32)  # 1-based rank among the columns equal to the cut, by column id
    drop = below | (tied & (tie_rank <= removed - below.sum(-1, keepdim=True)))
    return scores.masked_fill(drop, -float("inf")), unsure




def exact_top_split(processors: LogitsProcessorList) -> tuple[LogitsProcessorList, int, LogitsProcessorList] | None:
    """`topk_split`: after its -inf top-k only temperature and top-p, which `exact_top_columns` runs on k columns."""
    return topk_split(processors)


TIE_ROOM = 8  # columns past the k-th read for ties with it (a bfloat16 target's rows: 0-4 such ties seen, 40% of rows)


def exact_top_columns(k: int, late_head: LogitsProcessorList, tail: LogitsProcessorList, ids: torch.Tensor,
                      scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Transformers' rows as their top-k columns, bit for bit: `(values, columns, unsure)`, values and columns
    `(n, k + TIE_ROOM)` in descending order (every other column of Transformers' row is -inf; its kept columns carry
    exactly these values; the columns past the k-th are kept where they tie with it, as Transformers' top-k keeps
    them, and -inf otherwise), and `(n,)` flags, true where that may not hold: the ties with the k-th may go on past
    the room read, the row holds NaN or +inf, or a top-p cut may fall elsewhere on the row (`exact_top_p`).

    `scores` (any float dtype: the float32 conversion is exact and keeps the order) went through `exact_top_split`'s
    head but `late_head`, its temperatures when `deferred`: each divides and rounds the columns as it would have
    the row (same bits), keeps their order and can only create ties, which are read after it. `tail` holds
    temperatures (elementwise after the cut) and top-p (`exact_top_p`).
    """
    width = scores.shape[-1]
    kept = min(k, width)
    read = min(kept + TIE_ROOM, width)
    values, columns = row_topk(scores, read)
    values = values.float()
    for processor in late_head:
        values = processor(ids, values)
    unsure = values[:, 0].isnan() | values[:, 0].isposinf()  # topk ranks NaN first
    kth = values[:, kept - 1 : kept]
    tied = values[:, kept:] == kth
    if read < width:  # the last column read ties with the k-th: more may follow it (-inf ties: -inf either way)
        unsure |= tied[:, -1] & (kth[:, 0] > -float("inf"))
    values = torch.cat([values[:, :kept], values[:, kept:].masked_fill(~tied, -float("inf"))], dim=1)
    for processor in tail:
        if type(processor) is TopPLogitsWarper:
            values, flags = exact_top_p(values, processor.top_p, processor.min_tokens_to_keep)
            unsure |= flags
        else:
            values = processor(ids, values)  # temperature: elementwise, the same bits as on the row
    return values, columns, unsure


def exact_top_p(values: torch.Tensor, top_p: float, min_tokens_to_keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`TopPLogitsWarper` on a row's columns `(n, k)` with mass (descending, -inf allowed; the row is -inf
    elsewhere): the values with the columns Transformers' top-p removes set to -inf, and `(n,)` flags, true where
    that may not hold.

    Transformers sorts the whole row ascending: -inf, then these values reversed. Its softmax sums the same k
    terms in another order, so the probabilities and their cumulative sums may differ from the ones
    computed here in the last bits, by less than `_cumsum_slack(k)`; the cut (cumulative sum `<= 1 - top_p`) is
    the same unless a cumulative sum lies that close to it: flagged. So is a finite tie straddling the cut (which
    of the tied columns goes depends on the sort's order of ties).
    """
    k = values.shape[-1]
    ascending = values.flip(-1)
    cumulative = ascending.softmax(-1).cumsum(-1)
    threshold = 1 - top_p
    remove = cumulative <= threshold  # Transformers' expression
    keep_last = min(min_tokens_to_keep, k)
    remove[..., k - keep_last :] = False
    near = (cumulative - threshold).abs() <= _cumsum_slack(k)
    near[..., k - keep_last :] = False
    removed = remove.sum(-1, keepdim=True)  # a prefix: the cumulative sum only grows
    last_removed = ascending.gather(-1, (removed - 1).clamp(min=0))
    first_kept = ascending.gather(-1, removed.clamp(max=k - 1))
    straddles = (removed > 0) & (removed < k) & (last_removed == first_kept) & (first_kept > -float("inf"))
    return values.masked_fill(remove.flip(-1), -float("inf")), near.any(-1) | straddles[:, 0]


def _cumsum_slack(k: int) -> float:
    """A bound on how far a float32 cumulative sum of k softmax terms can move when the same terms are summed in
    another order (the normaliser) and exponentiated by another kernel: a few units in the last place per term."""
    return (4 * k + 16) * torch.finfo(torch.float32).eps
