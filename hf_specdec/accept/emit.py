"""Emitting an accepted block: append its tokens to the sequence and run the stopping criteria, at once where a
stop anywhere in the block shows at its end, else token by token so a stop lands where plain `generate`'s does."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria


@dataclass(frozen=True)
class BlockStops:
    """When an accepted block can be emitted at once: every stopping criterion is one whose firing anywhere in the
    block shows at its end (a length or time limit) or an end-of-sequence id the host spots in the block's tokens."""

    monotone: bool  # no criterion but max length, max time and end-of-sequence ids
    eos: frozenset[int]

    @classmethod
    def of(cls, criteria: StoppingCriteriaList) -> BlockStops:
        eos = set()
        for criterion in criteria:
            if isinstance(criterion, EosTokenCriteria):
                eos.update(torch.as_tensor(criterion.eos_token_id).flatten().tolist())
        monotone = all(isinstance(c, (MaxLengthCriteria, MaxTimeCriteria, EosTokenCriteria)) for c in criteria)
        return cls(monotone, frozenset(eos))


def emit(
    input_ids: torch.LongTensor,
    block: list[int],
    block_scores: torch.Tensor,
    criteria: StoppingCriteriaList,
    stops: BlockStops,
) -> tuple[torch.LongTensor, int, bool]:
    """Append the accepted `block` (`block_scores`: each token's processed scores); returns the sequence, how many
    tokens went in and whether decoding stops.

    One `cat` and one stopping check for the whole block when `stops` allows; otherwise (or when that check fires)
    token by token, so a stop lands on the very token where plain generate's check fires.
    """
    grown = torch.cat([input_ids, torch.tensor([block], dtype=input_ids.dtype).to(input_ids.device)], dim=1)
    if stops.monotone and stops.eos.isdisjoint(block) and not bool(criteria(grown, block_scores[-1:]).any()):
        return grown, len(block), False
    start = input_ids.shape[1]
    for emitted in range(1, len(block) + 1):
        if bool(criteria(grown[:, : start + emitted], block_scores[emitted - 1 : emitted]).any()):
            return grown[:, : start + emitted], emitted, True
    return grown, len(block), False
