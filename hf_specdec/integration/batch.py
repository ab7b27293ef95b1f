"""A batch of prompts (several rows, left-padded by the tokenizer, or `num_return_sequences` copies): one drafter
per row, one target pass per step over every row still decoding (`decoding.batch_loop`).

What a batch refuses (a user cache, static caches, per-token output records, streamers, ...) is checked up front
in `validation.check_batch`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from ..accept.kv_cache import full_length_cache
from ..core.config import SpeculationConfig
from ..core.model_info import vocab_size
from ..core.processing import row_processors
from ..decoding.batch_loop import RowDrafters, batch_speculative_loop
from ..decoding.outputs import SpeculativeDecoderOnlyOutput
from ..decoding.stats import SpeculationStats
from ..draft.batch_shaped import LockstepShapeDrafter
from ..draft.guarded import GuardedDrafter
from ..methods.static_shape import StaticShapeConfig
from ..plan.sizing import choose_plan, for_batch
from .call import SpeculationCall


def decode_batch(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    call: SpeculationCall,
    config: SpeculationConfig,
    verifier,
    model_kwargs: dict[str, Any],
    plan_seconds: float = 0.0,
) -> torch.LongTensor | SpeculativeDecoderOnlyOutput:
    """Run the batch loop; with return_dict_in_generate, `speculation_stats` is a list (one entry per row) and
    `past_key_values` the cache laid out as plain batched generate's (see `decoding.batch_cache`)."""
    check_stops(stopping_criteria)
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    drafter = batch_drafter(model, input_ids.shape[0], logits_processor, call, config, verifier)
    stats = [SpeculationStats(method=config.method, verifier=verifier.name, plan_source=config.plan_source,
                              time_plan=plan_seconds) for _ in range(input_ids.shape[0])]
    cache = full_length_cache(model_kwargs.get("past_key_values"))  # generate's empty cache, every row kept
    pad = generation_config._pad_token_tensor
    pad_token_id = int(pad) if pad is not None else int(generation_config.pad_token_id or 0)
    inputs = {k: v for k, v in model_kwargs.items() if k not in ("attention_mask", "past_key_values")}
    # the cache as plain returns it: column j of row r holds sequences[r, j]'s key/value (zeros after a row's end)
    returns_cache = bool(generation_config.return_dict_in_generate and generation_config.use_cache)
    result = batch_speculative_loop(model, input_ids, mask, drafter, verifier, logits_processor, stopping_criteria,
                                    pad_token_id, generator=call.generator, stats=stats, model_kwargs=inputs,
                                    cache=cache, returns_cache=returns_cache)
    if not generation_config.return_dict_in_generate:
        return result.sequences
    return SpeculativeDecoderOnlyOutput(sequences=result.sequences, past_key_values=result.cache,
                                        speculation_stats=result.stats)


def batch_drafter(model: PreTrainedModel, rows: int, logits_processor: LogitsProcessorList, call: SpeculationCall,
                  config: SpeculationConfig, verifier) -> RowDrafters | LockstepShapeDrafter:
    """A fixed shape (chain, tree, sequoia: its plan's tree, not sized per step in a batch) is drafted for all rows
    in lockstep, one draft pass per level; any other method drafts row by row with a drafter per row."""
    processors = [row_processors(logits_processor, row, rows) for row in range(rows)]
    if isinstance(config, StaticShapeConfig):
        return LockstepShapeDrafter(call.assistant_model, batch_shape(config, rows), rows, processors,
                                    verifier.child_selection, call.generator, vocab_size(model))
    drafters = []
    for row in range(rows):  # each row its own draft cache and state
        drafter = config.make_drafter(model, call.assistant_model, processors[row], verifier.child_selection,
                                      call.generator)
        drafters.append(GuardedDrafter(drafter) if config.guard else drafter)
    return RowDrafters(drafters)


def batch_drafts(config: SpeculationConfig, rows: int) -> bool:
    """Whether any tree pays for this batch: a fixed shape sized for it may be the root alone (then the batch
    decodes with Transformers' own loop, as a root-only plan does for one sequence)."""
    return not isinstance(config, StaticShapeConfig) or len(batch_shape(config, rows)) > 1


def batch_shape(config: StaticShapeConfig, rows: int) -> list[int]:
    """The shape every row drafts. A sequoia plan looked up with its latency profile is sized again for the batch
    (a pass over `rows` trees of n nodes costs what rows * n tokens cost, so trees shrink as the batch grows); a
    fixed shape or a given plan is kept."""
    plan = getattr(config, "plan", None)
    if not getattr(config, "sized", False) or getattr(plan, "profile", None) is None:
        return config.shape()
    return choose_plan(plan.acceptance, for_batch(plan.profile, rows), config.max_budget,
                       config.max_depth).plan.parents


def check_stops(criteria: StoppingCriteriaList) -> None:
    """Without an end-of-sequence id, plain batched `generate` keeps decoding a row that a stop string (or a custom
    criterion) stopped, until every row has stopped; a speculative batch stops each row where it stops: refused."""
    if any(isinstance(c, EosTokenCriteria) for c in criteria):
        return
    other = [type(c).__name__ for c in criteria if not isinstance(c, (MaxLengthCriteria, MaxTimeCriteria))]
    if other:
        raise ValueError(
            f"A batch with {', '.join(other)} but no eos_token_id: plain batched generate would go on decoding a row "
            "after it stops (and write no padding), which speculation does not copy. Set eos_token_id (and "
            "pad_token_id) in the generation config, or generate the prompts one at a time."
        )
