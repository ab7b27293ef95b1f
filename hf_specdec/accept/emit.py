"""Emitting an accepted block: append its tokens to the sequence and run the stopping criteria, at once where a
stop anywhere in the block shows at its end, else token by token so a stop lands where plain `generate`'s does."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria


@dataclass(frozen=True)
class BlockStops:
    """When an accepted block can be checked once, at its end: every stopping criterion is one whose firing anywhere
    in the block shows at its end (a length or time limit) or an end-of-sequence id the host spots in the block's
    tokens. The host also sees where the length limit falls, so only a time limit can fire unforeseen."""

    monotone: bool  # no criterion but max length, max time and end-of-sequence ids
    eos: frozenset[int]
    max_length: int | None = None  # the smallest length limit among the criteria
    timers: tuple[MaxTimeCriteria, ...] | None = None  # set when the host decides every check (see `on_host`)

    @classmethod
    def of(cls, criteria: StoppingCriteriaList) -> BlockStops:
        eos = set()
        for criterion in criteria:
            if isinstance(criterion, EosTokenCriteria):
                eos.update(torch.as_tensor(criterion.eos_token_id).flatten().tolist())
        monotone = all(isinstance(c, (MaxLengthCriteria, MaxTimeCriteria, EosTokenCriteria)) for c in criteria)
        limits = [c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)]
        on_host = all(type(c) in (MaxLengthCriteria, MaxTimeCriteria, EosTokenCriteria) for c in criteria)
        timers = tuple(c for c in criteria if type(c) is MaxTimeCriteria) if on_host else None
        return cls(monotone, frozenset(eos), min(limits) if limits else None, timers)

    @property
    def on_host(self) -> bool:
        """Whether the host decides every check as Transformers' own criteria would (they are exactly its length,
        time and end-of-sequence ones, which read the length, the clock and the last token): no device work."""
        return self.timers is not None

    def fired(self, length: int, last_token: int) -> bool:
        """What the criteria (`on_host`) say of a sequence of `length` tokens ending in `last_token`."""
        return ((self.max_length is not None and length >= self.max_length) or last_token in self.eos
                or any(time.time() - timer.initial_timestamp > timer.max_time for timer in self.timers))

    def may_stop(self, start: int, block: list[int]) -> bool:
        """Whether a criterion may fire inside `block` appended after `start` tokens for a reason other than time:
        then the block is checked token by token at once."""
        return (not self.monotone or not self.eos.isdisjoint(block)
                or (self.max_length is not None and start + len(block) >= self.max_length))


def block_scores(scores, path: list[int], stops: BlockStops) -> torch.Tensor:
    """What `emit` hands the stopping criteria as the processed scores of the tokens at `path`'s nodes: `scores[path]`
    (a `NodeScores` computes Transformers' rows it lacks), or, where every criterion is a length limit, a time limit
    or end-of-sequence ids (none reads the scores), an empty `(len(path), 0)` stand-in that costs nothing."""
    if stops.monotone:
        return torch.empty(len(path), 0, device=scores.device)
    return scores[path]


def emit(
    input_ids: torch.LongTensor,
    block: list[int],
    block_scores: torch.Tensor,
    criteria: StoppingCriteriaList,
    stops: BlockStops,
) -> tuple[torch.LongTensor, int, bool]:
    """Append the accepted `block` (`block_scores`: each token's processed scores); returns the sequence, how many
    tokens went in and whether decoding stops (`emit_rows` for one sequence)."""
    return emit_rows([(input_ids, block, block_scores)], criteria, stops)[0]


def emit_rows(
    rows: list[tuple[torch.LongTensor, list[int], torch.Tensor]],
    criteria: StoppingCriteriaList,
    stops: BlockStops,
) -> list[tuple[torch.LongTensor, int, bool]]:
    """`emit` for several sequences (each `(1, L_r)`, its block and the block's scores), their stopping checks
    decided on the host for Transformers' length, time and end-of-sequence criteria, else read in one transfer (two
    when a time limit passes inside a block).

    A block that may stop (`BlockStops.may_stop`) is checked after each of its tokens, so a stop lands on the very
    token where plain generate's check fires; any other block once, after its last token (and token by token, in
    the second transfer, when that fires: a time limit).
    """
    grown = [torch.cat([ids, torch.tensor([block], dtype=ids.dtype).to(ids.device, non_blocking=True)],
                         dim=1) for ids, block, _ in rows]
    starts = [ids.shape[1] for ids, _, _ in rows]
    each = [stops.may_stop(start, block) for start, (_, block, _) in zip(starts, rows)]
    scores = [block_scores for _, _, block_scores in rows]
    blocks = [block for _, block, _ in rows]
    fired = _stop_checks(grown, starts, blocks, scores, each, criteria, stops)
    late = [row for row, checks in enumerate(fired) if not each[row] and checks[0]]
    if late:
        for row, checks in zip(late, _stop_checks([grown[r] for r in late], [starts[r] for r in late],
                                                  [blocks[r] for r in late], [scores[r] for r in late],
                                                  [True] * len(late), criteria, stops)):
            fired[row], each[row] = checks, True
    out = []
    for row, (sequence, start, checks) in enumerate(zip(grown, starts, fired)):
        first = next((token for token, stop in enumerate(checks) if stop), None) if each[row] else None
        if first is None:
            out.append((sequence, sequence.shape[1] - start, False))
        else:
            out.append((sequence[:, : start + first + 1], first + 1, True))
    return out


def _stop_checks(grown: list[torch.LongTensor], starts: list[int], blocks: list[list[int]],
                 scores: list[torch.Tensor], each: list[bool], criteria: StoppingCriteriaList, stops: BlockStops,
                 ) -> list[list[bool]]:
    """Per sequence: whether the criteria fire after each token of its block (`each`) or after the whole block;
    decided on the host where it can (`BlockStops.on_host`), else computed where the sequences are and read back in
    one transfer."""
    if stops.on_host:
        return [[stops.fired(end, block[end - start - 1])
                 for end in (range(start + 1, start + len(block) + 1) if token_by_token else [start + len(block)])]
                for start, block, token_by_token in zip(starts, blocks, each)]
    checks, sizes = [], []
    for sequence, start, block_scores, token_by_token in zip(grown, starts, scores, each):
        ends = range(start + 1, sequence.shape[1] + 1) if token_by_token else [sequence.shape[1]]
        checks += [criteria(sequence[:, :end], block_scores[end - start - 1 : end - start]).any()[None]
                   for end in ends]
        sizes.append(len(ends))
    flat = torch.cat(checks).tolist()  # the one read
    out, at = [], 0
    for size in sizes:
        out.append(flat[at : at + size])
        at += size
    return out
