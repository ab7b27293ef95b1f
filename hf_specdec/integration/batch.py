"""A batch of prompts (several rows, left-padded by the tokenizer, or `num_return_sequences` copies): one drafter
per row, one target pass per step over every row still decoding (`decoding.batch_loop`).

A method drafting one shape (chain, tree, sequoia) drafts it for every row in lockstep, sized every step for the
batch where the call has latency curves and the guard is on (`draft.batch_sized`): the method's shape is the
largest a step drafts, smaller versions of it are chosen as the batch grows or acceptance falls, down to plain
batched steps. A call that no tree is predicted to repay (the draft's prompt pass included, its slowest row priced
by what earlier calls of its batch size measured) decodes with Transformers' own loop, as do the next calls of a
batch size after one measured slower than plain batched decoding (`PlainGuard.observe_call`). `specexec` grows
every row's best-first tree in lockstep too (`methods.specexec.lockstep`: each round's draft pass forwards every
row's frontier); `staged` drafts row by row; both are priced before their call the same way (staged's rows' draft
passes summed).
Curves come with the method's plan (tree, sequoia), or are looked up for the batch (chain, a shape given).

What a batch refuses (a user cache, static caches, per-token output records, streamers, ...) is checked up front
in `validation.check_batch`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

from ..accept.kv_cache import full_length_cache
from ..core.config import PlanRequest, SpeculationConfig
from ..core.releases import CACHE, cache_arg
from ..decoding.batch_loop import batch_speculative_loop
from ..decoding.outputs import SpeculativeDecoderOnlyOutput
from ..decoding.stats import SpeculationStats
from ..draft.batch_shaped import LockstepShapeDrafter
from ..draft.batch_sized import SizedLockstepDrafter
from ..draft.row_drafters import RowDrafters
from ..logits.processing import row_processors
from ..methods.sequoia.sizing import sequoia_menu
from ..methods.specexec import SpecExecConfig
from ..methods.specexec.lockstep import LockstepBestFirstDrafter, lockstep_drafter
from ..methods.static_shape import StaticShapeConfig
from ..methods.step_sized import PLAN_BUDGET, StepSizedConfig, online_sizer
from ..plan.call_pricing import PRICING_MARGIN, SLOWEST_ROW_SHARE, call_pays, saving_per_token
from ..plan.guard import BATCH_MARGIN, PlainGuard, remembered_guard
from ..plan.shape_sizing import RankAcceptance, ShapeMenu
from ..plan.sizing import for_batch, row_by_row
from ..runtime.attention import tree_attention_kernels
from ..runtime.devices import execution_device
from ..runtime.model_info import vocab_size
from .call import SpeculationCall, guard_key


class BatchCall:
    """One batched call, decided once it is known to draft: the target, the call's draft and settings, the method's
    config and verifier, the logits processors, the number of rows, and the plan looked up for the batch
    (`integration.generate.call_plan`), if any. `plainly` says whether Transformers' own loop decodes it instead;
    `decode` runs the batch loop."""

    def __init__(self, model: PreTrainedModel, call: SpeculationCall, config: SpeculationConfig, verifier,
                 logits_processor: LogitsProcessorList, rows: int, plan: Any = None, plan_seconds: float = 0.0
                 ) -> None:
        self.model, self.call, self.config, self.verifier = model, call, config, verifier
        self.logits_processor, self.rows, self.plan, self.plan_seconds = logits_processor, rows, plan, plan_seconds

    def plainly(self, prompt: int = 0, new_tokens: int | None = None) -> str | None:
        """Why this batch decodes with Transformers' own loop, or None where it speculates: a recent call of this
        batch size was measured slower than plain batched decoding (its guard waits: `PlainGuard.plain_call`), or no
        tree is predicted to pay for it (`drafts`)."""
        rows = self.rows
        guard = batch_guard(self.model, self.call, self.logits_processor, rows) if self.config.guard else None
        if guard is not None and guard.plain_call():
            seconds, plain = guard.last_call
            return (f"a recent call of {rows} rows took {seconds:.2f} s to decode against plain batched decoding's "
                    f"{plain:.2f} s (estimated from its measured steps): this call and {guard.calls_waiting} more "
                    "decode plainly before speculation is tried again")
        share = guard.slowest_share if guard is not None else SLOWEST_ROW_SHARE
        if not self.drafts(prompt, new_tokens, share):
            return (f"no tree is predicted to repay its cost over this batch's new tokens with {PRICING_MARGIN:.0%} "
                    "of plain batched decoding's time to spare")
        return None

    def drafts(self, prompt: int = 0, new_tokens: int | None = None, slowest_share: float = SLOWEST_ROW_SHARE
               ) -> bool:
        """Whether any tree pays for this batch: a fixed shape sized for it may be predicted to lose to plain
        batched steps from the first step, or to save less over the call's `new_tokens` per row than the draft's
        prefill over every row's `prompt` tokens costs, with a margin for the prediction's error
        (`plan.call_pricing`); then the batch decodes with Transformers' own loop, as a root-only plan does for one
        sequence. Predicted with the curves as the rows see them and the plan's acceptance for every row, the
        slowest row adding `slowest_share` of what it predicts (`call_pricing.SLOWEST_ROW_SHARE`).

        A best-first method with curves (specexec, staged sized every step) is priced as the DP's best trees for
        the plan's acceptance would be (its own trees are not known before they are drafted): `specexec`'s rows in
        lockstep (`sizing.for_batch`), `staged`'s every row's draft passes and prompt pass run one after another
        (`sizing.row_by_row`; its lower stages make its drafting cheaper than that: priced on the safe side). Other
        methods (prompt lookup, a fixed budget) are unpriced."""
        config, rows = self.config, self.rows
        if isinstance(config, StaticShapeConfig):
            sizing = batch_sizing(config, self.plan)
            if sizing is None:
                return len(config.shape()) > 1
            menu, acceptance, profile, batched = config.shape_menu(), sizing.acceptance, sizing.profile, for_batch
        elif isinstance(config, StepSizedConfig) and config.profile is not None and config.acceptance is not None:
            menu = sequoia_menu(config.acceptance, PLAN_BUDGET, config.max_depth)
            acceptance, profile = config.acceptance, config.profile
            batched = for_batch if isinstance(config, SpecExecConfig) else row_by_row  # specexec: in lockstep
        else:
            return True
        sizer = online_sizer(profile, self.model, self.call.assistant_model, self.logits_processor)
        sizer.profile = batched(sizer.profile, rows)
        per_token = menu.seconds_per_token(sizer, [RankAcceptance(acceptance, menu.width)] * rows, slowest_share)
        if new_tokens is None:
            return saving_per_token(per_token)[0] != 0
        # the draft's first pass feeds every row its prompt: prompt tokens per row on the curves the batch sees
        return call_pays(per_token, rows * new_tokens, float(sizer.draft_seconds(prompt)))

    def drafter(self) -> RowDrafters | LockstepShapeDrafter | LockstepBestFirstDrafter:
        """A fixed shape (chain, tree, sequoia) is drafted for all rows in lockstep, one draft pass per level: sized
        every step for the batch where it has curves (`batch_sizing`), else the shape whole every step; `specexec`
        grows every row's tree in lockstep; any other method drafts row by row with a drafter per row
        (`RowDrafters`); each behind one guard for the batch's whole steps."""
        model, rows, config, draft = self.model, self.rows, self.config, self.call.assistant_model
        selection, generator = self.verifier.child_selection, self.call.generator
        processors = [row_processors(self.logits_processor, row, rows) for row in range(rows)]
        if isinstance(config, StaticShapeConfig):
            if not config.guard:  # the shape whole, every step
                return LockstepShapeDrafter(draft, config.shape(), rows, processors, selection, generator,
                                            vocab_size(model), config.stop_below())
            sizing = batch_sizing(config, self.plan)
            if sizing is None:  # no curves: the shape whole, behind the guard
                menu, sizer, ranks = ShapeMenu.of([config.shape()]), None, []
            else:
                menu = config.shape_menu()
                sizer = online_sizer(sizing.profile, model, draft, self.logits_processor)
                ranks = [RankAcceptance(sizing.acceptance, menu.width) for _ in range(rows)]
            return SizedLockstepDrafter(draft, menu, sizer, ranks, len(config.shape()), rows, processors, selection,
                                        generator, vocab_size(model),
                                        batch_guard(model, self.call, self.logits_processor, rows),
                                        config.stop_below())
        guard = batch_guard(model, self.call, self.logits_processor, rows) if config.guard else None
        if isinstance(config, SpecExecConfig):  # every row's best-first tree, one draft pass a round for all rows
            return lockstep_drafter(config, model, draft, processors, vocab_size(model), guard)
        drafters = [config.make_drafter(model, draft, processors[row], selection, generator)  # each its own state
                    for row in range(rows)]
        return RowDrafters(drafters, guard)

    def decode(self, input_ids: torch.LongTensor, stopping_criteria: StoppingCriteriaList,
               generation_config: GenerationConfig, model_kwargs: dict[str, Any]
               ) -> torch.LongTensor | SpeculativeDecoderOnlyOutput:
        """Run the batch loop; with return_dict_in_generate, `speculation_stats` is a list (one entry per row) and
        its cache the one laid out as plain batched generate's (see `decoding.batch_cache`)."""
        check_stops(stopping_criteria)
        model, config, verifier = self.model, self.config, self.verifier
        mask = model_kwargs.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask
        drafter = self.drafter()
        stats = [SpeculationStats(method=config.method, verifier=verifier.name, plan_source=config.plan_source,
                                  time_plan=self.plan_seconds) for _ in range(input_ids.shape[0])]
        cache = full_length_cache(model_kwargs.get(CACHE))  # generate's empty cache, every row kept
        pad = generation_config._pad_token_tensor
        pad_token_id = int(pad) if pad is not None else int(generation_config.pad_token_id or 0)
        inputs = {k: v for k, v in model_kwargs.items() if k not in ("attention_mask", CACHE)}
        # the cache as plain returns it: column j of row r holds sequences[r, j]'s key/value (zeros after a row's end)
        returns_cache = bool(generation_config.return_dict_in_generate and generation_config.use_cache)
        with tree_attention_kernels(execution_device(model)):  # cuDNN left out (core.attention)
            result = batch_speculative_loop(model, input_ids, mask, drafter, verifier, self.logits_processor,
                                            stopping_criteria, pad_token_id, generator=self.call.generator,
                                            stats=stats, model_kwargs=inputs, cache=cache,
                                            returns_cache=returns_cache, lean=config.lean_target)
        guard = drafter.guard
        if guard is not None:  # the whole call, the draft's prompt pass included, judged against plain batched decoding
            rows, first = result.stats, result.stats[0]
            guard.observe_call(first.time_total - first.time_prefill, [row.new_tokens for row in rows],
                               [speculative_rate(row) for row in rows])
        if not generation_config.return_dict_in_generate:
            return result.sequences
        return SpeculativeDecoderOnlyOutput(sequences=result.sequences, **cache_arg(result.cache),
                                            speculation_stats=result.stats)


def speculative_rate(stats: SpeculationStats) -> float:
    """A row's tokens per speculative step (plain steps, the root alone, emit one token each); 0 without one."""
    steps = stats.target_forwards - stats.plain_steps
    return (stats.new_tokens - stats.plain_steps) / steps if steps > 0 else 0.0


def batch_guard(model: PreTrainedModel, call: SpeculationCall, logits_processor: LogitsProcessorList, rows: int
                ) -> PlainGuard:
    """The measured guard of a batch's whole steps, judging against plain batched steps (measured, not estimated),
    as the last call with this batch size left it."""
    return remembered_guard(model, call.assistant_model, guard_key(call, logits_processor, rows),
                            lambda: PlainGuard(measure_plain=True, margin=BATCH_MARGIN))


def batch_plan_request(config: SpeculationConfig) -> PlanRequest | None:
    """What a batch looks up for a fixed shape whose config asks for nothing (chain, a tree given by its shape): the
    pair's plan, for its latency curves and acceptance (stored, or a stored one re-sized here; never calibrated
    for the batch: without one the shape is drafted whole, behind the guard). None where the config looks its own
    plan up, or drafts its shape whole (`guard=False`, `per_step=False`)."""
    if not isinstance(config, StaticShapeConfig) or not _sized_in_a_batch(config) or config.plan_request():
        return None
    return PlanRequest(max_budget=PLAN_BUDGET, calibrate_online=False)


def batch_sizing(config: SpeculationConfig, plan: Any = None) -> Any:
    """The plan (its `profile`: latency curves; its `acceptance`: the prior) a batch drafting `config`'s shape is
    sized with every step: the one looked up for the batch, else the config's own; None where there are no curves
    (a plan given without them) or the shape is drafted whole."""
    if not isinstance(config, StaticShapeConfig) or not _sized_in_a_batch(config):
        return None
    plan = plan if plan is not None else getattr(config, "plan", None)
    return plan if getattr(plan, "profile", None) is not None else None


def _sized_in_a_batch(config: StaticShapeConfig) -> bool:
    return config.guard and getattr(config, "per_step", True)


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
