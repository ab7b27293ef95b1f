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
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

# After a top-k, these may follow: temperature keeps -inf at -inf and is elementwise; top-p is replaced below.
_TAIL = (TemperatureLogitsWarper, TopPLogitsWarper)


def narrowed_plan(processors: LogitsProcessorList) -> tuple[LogitsProcessorList, int, LogitsProcessorList] | None:
    """`(head, k, tail)` where the list is head (ending with a -inf top-k keeping k) then temperature/top-p only.

    None where nothing can be narrowed: no such top-k, a top-p or top-k with another filter value, any other
    processor after the top-k (its effect on -inf columns is unknown), or no top-p to gain from.
    """
    last = max((i for i, p in enumerate(processors) if type(p) is TopKLogitsWarper), default=None)
    if last is None or processors[last].filter_value != -float("inf"):
        return None
    tail = LogitsProcessorList(processors[last + 1 :])
    if not all(type(p) in _TAIL for p in tail) or not any(type(p) is TopPLogitsWarper for p in tail):
        return None
    if any(type(p) is TopPLogitsWarper and p.filter_value != -float("inf") for p in tail):
        return None
    return LogitsProcessorList(processors[: last + 1]), processors[last].top_k, tail


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
    top = torch.topk(scores, k).values  # descending; the k-th is the smallest finite score (or -inf)
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
