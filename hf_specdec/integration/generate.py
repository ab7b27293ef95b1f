"""How `speculation=` reaches the loop: a thin wrapper around `GenerationMixin.generate`.

The wrapper leaves every call without `speculation` untouched. With it, the call goes through
Transformers' own `generate` (input preparation, processors, stopping criteria, cache) with a
`custom_generate` callable: the speculative loop. Transformers hands a callable neither the assistant, the
streamer nor the tokenizer, so they travel inside one `SpeculationCall` argument. Every refusal comes first,
on the call's settings merged as `generate` will merge them, before Transformers prepares anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import time
from typing import Any

import torch
from transformers import (
    CompileConfig,
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerationMixin
from transformers.utils import logging

from ..accept.kv_cache import full_length_cache, is_static, make_room, static_capacity
from ..core.config import ModelDraftConfig, SpeculationConfig, make_config
from ..core.model_inputs import TokenInputs
from ..core.releases import CACHE, cache_arg, with_cache_name
from ..decoding.captured import CapturedSampling, captured_loop, captured_refusal
from ..decoding.loop import speculative_loop
from ..decoding.outputs import SpeculativeDecoderOnlyOutput, TokenRecords
from ..decoding.stats import SpeculationStats
from ..draft.guarded import GuardedDrafter
from ..logits.processing import row_processors
from ..methods.sequoia.lookup import call_temperature, plan_for_call
from ..runtime.attention import keeps_state, tree_attention_kernels
from ..runtime.devices import execution_device
from ..runtime.faster_call import GRAPHS_PER_FUNCTION, FasterCall
from ..runtime.model_info import vocab_size
from ..runtime.ranks import Ranks
from ..verify import verifier_for
from .batch import BatchCall, batch_plan_request
from .call import SpeculationCall, guard_key
from .generation_config import FIELD, get_speculation, keep_field_on_load
from .validation import check_generation_config, check_processors, check_speculation

logger = logging.get_logger(__name__)
FIRST_CALL_NOTICE_SECONDS = 1.0  # a plan lookup this long is a first call on new hardware: say what it cost

_ORIGINAL_GENERATE = GenerationMixin.generate
_SIGNATURE = inspect.signature(_ORIGINAL_GENERATE)
SPECULATION_KWARGS = ("speculation", "speculation_config", "speculation_generator")
# What Transformers' generate takes out of **kwargs before merging the rest into the generation config.
_NOT_SETTINGS = {*_SIGNATURE.parameters, "trust_remote_code", "tokenizer", "assistant_tokenizer"}
# Rows added to a static cache generate builds (cache_implementation="static", no max_cache_len): plain decoding
# sizes it to the call's tokens, and without room a tree near the end loses levels to fit (`core.pass_shapes`).
TREE_ROOM = 64
# Rows the draft's static cache has on top of the target's: the nodes a step forwards and their padding (it grows
# past them if a step needs more).
DRAFT_ROOM = 256


def stored_speculation(model: PreTrainedModel, kwargs: dict[str, Any]) -> SpeculationConfig | None:
    """The `speculation` field of the call's generation config, else of the model's (Transformers' precedence)."""
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        if getattr(config, FIELD, None) is not None:
            return get_speculation(config)
    return None


@functools.wraps(_ORIGINAL_GENERATE)
def generate(self, *args, **kwargs):
    """`GenerationMixin.generate`, plus `speculation=` (see hf_specdec's README).

    `speculation=None` means plain `generate`. A setting stored in the generation config is a default: it applies
    to the calls it can run, and any other call (a batch, beam search, no draft, ...) generates plainly.
    """
    if kwargs.get("custom_generate") is not None:
        # Someone else's decoding loop (or hf_specdec's own Hub folder, which calls back into this function):
        # hand it every argument, `speculation` included.
        return _ORIGINAL_GENERATE(self, *args, **kwargs)
    if args:
        kwargs = {**_SIGNATURE.bind_partial(self, *args).arguments, **kwargs}
        kwargs.pop("self")
    explicit = "speculation" in kwargs
    options = {name: kwargs.pop(name, None) for name in SPECULATION_KWARGS}
    speculation = options["speculation"] if explicit else stored_speculation(self, kwargs)
    given = [name for name, value in options.items() if value is not None]
    if speculation is None:
        if given:
            raise ValueError(f"{', '.join(given)} given without `speculation`: pass speculation=<method name> too.")
        return _ORIGINAL_GENERATE(self, **kwargs)
    config = _config_for_call(speculation, options["speculation_config"])
    kwargs = with_cache_name(kwargs)  # the caller's cache under this release's name, whichever name it came by
    try:
        call, generation_config = _checked_call(self, config, kwargs, options["speculation_generator"])
    except ValueError:
        if given:  # asked for in this call: the refusal is the answer
            raise
        return _ORIGINAL_GENERATE(self, **kwargs)  # a stored default this call cannot run: plain generate
    kwargs = _for_transformers(self, kwargs, call, generation_config)
    return _ORIGINAL_GENERATE(self, custom_generate=speculative_generate, speculation_call=call, **kwargs)


def _checked_call(
    model: PreTrainedModel, config: SpeculationConfig, kwargs: dict[str, Any], generator: torch.Generator | None
) -> tuple[SpeculationCall, GenerationConfig]:
    """The call's `SpeculationCall` and merged generation config, once every refusal is out of the way: checked on
    the settings merged exactly as `generate` will merge them, before Transformers prepares (or changes) anything."""
    settings = {name: value for name, value in kwargs.items() if name not in _NOT_SETTINGS}
    generation_config, model_kwargs = model._prepare_generation_config(kwargs.get("generation_config"), **settings)
    call = SpeculationCall(
        config=config,
        assistant_model=kwargs.get("assistant_model"),
        streamer=kwargs.get("streamer"),
        generator=generator,
        tokenizer=kwargs.get("tokenizer"),
        stop_strings=generation_config.stop_strings,
    )
    check_speculation(model, call, kwargs, generation_config, model_kwargs)
    return call, generation_config


def _for_transformers(
    model: PreTrainedModel, kwargs: dict[str, Any], call: SpeculationCall, generation_config: GenerationConfig
) -> dict[str, Any]:
    """The arguments Transformers gets: what travels in `call` taken out, stop strings and token healing (which
    need the tokenizer it would drop) handled here."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("assistant_model", "streamer", "tokenizer")}
    if call.stop_strings is not None:
        kwargs["stop_strings"] = None  # checked by the loop (StopStringCriteria), with the tokenizer
    if generation_config.token_healing:  # as generate does it: heal the prompt first, then decode from it
        name = "inputs" if kwargs.get("inputs") is not None else "input_ids"
        kwargs[name] = model.heal_tokens(kwargs[name], call.tokenizer)
        kwargs["token_healing"] = False
        if kwargs.get("attention_mask") is not None:  # all ones (padded prompts are refused): the healed length
            kwargs["attention_mask"] = torch.ones_like(kwargs[name])
    return kwargs


def _config_for_call(speculation: Any, speculation_config: SpeculationConfig | dict | None) -> SpeculationConfig:
    """`speculation` names the method; `speculation_config` is either its settings (dict) or a whole config."""
    if isinstance(speculation_config, SpeculationConfig):
        if isinstance(speculation, str) and speculation != speculation_config.method:
            raise ValueError(
                f"speculation={speculation!r} but speculation_config is a {speculation_config.method!r} config: "
                "make them agree, or pass only the config as `speculation=`."
            )
        return make_config(speculation_config)
    if speculation_config is not None and not isinstance(speculation_config, dict):
        raise TypeError("`speculation_config` must be a dict of settings or a SpeculationConfig.")
    return make_config(speculation, speculation_config)


def speculative_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    speculation_call: SpeculationCall | None = None,
    **model_kwargs,
):
    """The `custom_generate` callable: Transformers has prepared everything; run the speculative loop."""
    call = speculation_call
    check_generation_config(model, generation_config, input_ids, model_kwargs)  # again, on the prepared inputs
    check_processors(logits_processor)
    stopping_criteria = with_stop_strings(stopping_criteria, call)
    do_sample = bool(generation_config.do_sample)
    verifier = verifier_for(call.config, do_sample)
    config = call.config
    ranks = Ranks.of(model)  # a sharded target's ranks: the lowest decides what depends on clocks, files, draws
    batch = input_ids.shape[0]
    config, batch_plan, plan_seconds = call_plan(config, batch, model, call, generation_config, input_ids,
                                                 model_kwargs, ranks)
    records, token_inputs = TokenRecords.asked_by(generation_config), TokenInputs.of(model, input_ids, model_kwargs)
    captured, drafter = getattr(config, "captured", False) and config.drafts(), None
    if captured:  # refused before anything is decoded or streamed
        drafter = config.make_drafter(model, call.assistant_model, logits_processor, verifier.child_selection,
                                      call.generator)
        compiled = compiles(model, model_kwargs.get(CACHE), generation_config)
        refusal = captured_refusal(drafter, model_kwargs.get(CACHE), logits_processor, stopping_criteria,
                                   verifier.name, records, bool(token_inputs.prompt), ranks.shared,
                                   batch, call.generator if compiled else None)
        if refusal is not None:
            raise ValueError(f"speculation={config.method!r} with captured=True cannot decode this call: {refusal}.")
    plainly = "the plan is the root alone"  # why Transformers' own loop decodes the call, if it does
    if batch > 1 and config.drafts():
        batch_call = BatchCall(model, call, config, verifier, logits_processor, batch, batch_plan, plan_seconds)
        plainly = batch_call.plainly(*call_length(input_ids, model_kwargs, generation_config))
        if plainly is None:  # one target pass per step, every row
            return batch_call.decode(input_ids, stopping_criteria, generation_config, model_kwargs)
    guard, price, pays = None, "", True
    if batch == 1 and config.drafts() and config.guard:  # priced before it drafts, as the last calls measured
        guard = GuardedDrafter.guard_for(model, call.assistant_model, guard_key(call, logits_processor, 1))
        prompt, new_tokens = call_length(input_ids, model_kwargs, generation_config)
        window = config.window_tokens() if isinstance(config, ModelDraftConfig) else None
        priced = guard.price(new_tokens, prompt if window is None else min(prompt, window)) if ranks.deciding else None
        pays, price = ranks.decided(priced)  # a sharded target: every rank decodes as the deciding rank priced
    if call.streamer is not None:
        call.streamer.put(input_ids.cpu())
    if not config.drafts() or batch > 1 or not pays:  # no tree pays (for this call): Transformers' own loop
        return _decode_plainly(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                               call, config, verifier.name, model_kwargs, plainly if pays else price, price)
    cache = model_kwargs.get(CACHE)
    drafter = drafter or config.make_drafter(model, call.assistant_model, logits_processor, verifier.child_selection,
                                             call.generator)
    rows = max(generation_config.max_length - 1, generation_config.max_cache_len or 0)
    if is_static(cache) and not getattr(cache, "_is_user_defined", False) and generation_config.max_cache_len is None:
        # a static cache Transformers sized for plain decoding: room for the last trees too, on top of the rows it
        # gave (the longest call's so far, so that a compiled forward keeps its shapes from call to call)
        rows = max(rows, static_capacity(cache) or 0) + TREE_ROOM
        make_room(cache, rows)
    # sliding windows go into the tree masks; a static cache's sliding layers become full ones of `rows` rows
    cache = full_length_cache(cache, capacity=rows)
    compiled = compiled_forward(model, cache, generation_config)
    forward = None if compiled is None else FasterCall(model, compiled, execution_device(model))
    if isinstance(config, ModelDraftConfig):
        drafter.use_window(config.window_tokens())
    if config.guard and not captured:  # judged as the last call with these settings left it (captured: by the loop)
        drafter = GuardedDrafter(drafter, guard)
    if is_static(cache):  # the draft decodes on a static cache too, compiled when the target's forward is
        drafter.use_static_cache(rows + DRAFT_ROOM, lambda draft, draft_cache: None if forward is None else
                                 compiled_forward(draft, draft_cache, generation_config))
    stats = SpeculationStats(method=config.method, verifier=verifier.name, plan_source=config.plan_source,
                             compiled=forward is not None, time_plan=plan_seconds, call_price=price)
    # eager tree passes on CUDA run without cuDNN's SDPA (core.attention); compiled ones keep their traced kernels
    kernels = tree_attention_kernels(execution_device(model)) if forward is None else contextlib.nullcontext()
    with kernels:
        if captured:  # compiled whole where the call compiles its forward, with the call's compile settings
            step = (None if forward is None else
                    lambda run: torch.compile(run, **(generation_config.compile_config or CompileConfig()).to_dict()))
            processors = row_processors(logits_processor, 0, 1)  # the nodes are rows of one sequence
            sampling = CapturedSampling(processors, call.generator) if do_sample else None
            # a graph per shape (a sized call's buckets, a shape cut near the cache's end): past Dynamo's 8 a
            # function runs eagerly, so the limit is raised as for the compiled tree passes (`faster_call`)
            limit = max(torch._dynamo.config.recompile_limit, GRAPHS_PER_FUNCTION)
            with torch._dynamo.config.patch(recompile_limit=limit):
                result = captured_loop(model, input_ids, drafter, cache, stopping_criteria, vocab_size(model),
                                       streamer=call.streamer, stats=stats,
                                       model_kwargs={**model_kwargs, CACHE: cache}, compile_step=step,
                                       sampling=sampling, guard=guard, processors=processors)
        else:
            result = speculative_loop(
                model, input_ids, drafter, verifier, cache, logits_processor, stopping_criteria,
                streamer=call.streamer,
                generator=call.generator,
                records=records,
                stats=stats,
                model_kwargs={**model_kwargs, CACHE: cache},
                token_inputs=token_inputs,
                ranks=ranks,
                forward=forward,
                lean=config.lean_target,
                depth_first_order=config.depth_first,
            )
    if not generation_config.return_dict_in_generate:
        return result.sequences
    return SpeculativeDecoderOnlyOutput(
        sequences=result.sequences,
        **result.records.fields(),
        **cache_arg(cache if generation_config.use_cache else None),
        speculation_stats=result.stats,
    )


def call_plan(config: SpeculationConfig, batch: int, model: PreTrainedModel, call: SpeculationCall,
              generation_config: GenerationConfig, input_ids: torch.LongTensor, model_kwargs: dict[str, Any],
              ranks: Ranks) -> tuple[SpeculationConfig, Any, float]:
    """The call's plan, resolved once before decoding: (the config to draft with, the plan a batch sizes a fixed
    shape with or None, the seconds it took). The config's own plan (`plan_request`: given, stored, re-sized or
    calibrated now) goes into the config (`with_plan`); a batch drafting a fixed shape whose config asks for none
    borrows the pair's stored plan for its latency curves and acceptance (`batch_plan_request`; never calibrated for
    a batch: without one the shape is drafted whole, behind the guard)."""
    request = config.plan_request()
    for_batch = request is None and batch > 1
    request = batch_plan_request(config) if for_batch else request
    if request is None:
        return config, None, 0.0
    if any(m is not None and keeps_state(m) for m in (model, call.assistant_model)):  # a chain (nothing else runs)
        config = dataclasses.replace(config)
        config.plan_source = ("no plan: a model keeps a recurrent state, and a plan's latency curves are measured "
                              "with tree passes it cannot run; the chain stops on the draft's confidence")
        return config, None, 0.0
    start = time.perf_counter()
    try:
        plan, source = plan_for_call(request, model, call.assistant_model, call_temperature(generation_config),
                                     first_prompt(input_ids, model_kwargs.get("attention_mask")), ranks)
    except ValueError:
        if not for_batch:
            raise
        plan, source = None, None  # no plan stored for this pair
    seconds = time.perf_counter() - start
    if for_batch:
        config = dataclasses.replace(config)
        config.plan_source = ("no plan stored for this pair: its shape drafted whole for the batch, behind the guard"
                              if plan is None else
                              f"steps sized for the batch with the latency curves and acceptance of {source}")
        return config, plan, seconds
    config = config.with_plan(plan, source)
    if seconds >= FIRST_CALL_NOTICE_SECONDS:  # re-sized or calibrated here: once per pair and hardware
        logger.warning(f"hf_specdec: speculation={config.method!r} spent {seconds:.1f} s before decoding on its plan "
                       f"({config.plan_source}); later calls reuse it.")
    return config, None, seconds


def call_length(input_ids: torch.LongTensor, model_kwargs: dict[str, Any], generation_config: GenerationConfig
                ) -> tuple[int, int]:
    """(the longest prompt of the batch without its padding, the new tokens a row may generate): what a batch's
    draft prefill costs and the most tokens it can repay it over."""
    mask = model_kwargs.get("attention_mask")
    prompt = input_ids.shape[1] if mask is None else int(mask.sum(dim=1).max())
    return prompt, max(int(generation_config.max_length) - input_ids.shape[1], 0)


def first_prompt(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None) -> torch.LongTensor:
    """The first row of the call's prompts without its padding `(1, L)`: what a plan made online calibrates on."""
    if attention_mask is None or input_ids.shape[0] == 1:
        return input_ids[:1]
    return input_ids[:1, attention_mask[0].bool()]


def compiled_forward(model: PreTrainedModel, cache: Any, generation_config: GenerationConfig):
    """The compiled `model.__call__` plain `generate` would decode with for this call and cache, or None (eager).

    Transformers' own rule decides (`_valid_auto_compile_criteria`: a compileable cache that is not a DynamicCache, a
    GPU or `compile_config._compile_all_devices`, no offloading, `disable_compile` unset) and its own compiled call
    is used (`get_compiled_call(compile_config)`), so a call compiles exactly when plain generate's would, and the
    graphs are shared with it. A forward the user compiled themselves is simply the model's call.
    """
    if not compiles(model, cache, generation_config):
        return None
    return model.get_compiled_call(generation_config.compile_config)


def compiles(model: PreTrainedModel, cache: Any, generation_config: GenerationConfig) -> bool:
    """Whether plain `generate` would compile its decoding steps for this call and cache (Transformers' own rule)."""
    return model._valid_auto_compile_criteria(cache_arg(cache), generation_config)


def with_stop_strings(criteria: StoppingCriteriaList, call: SpeculationCall) -> StoppingCriteriaList:
    """The call's stop strings as Transformers would add them (a StopStringCriteria you passed takes precedence)."""
    if call.stop_strings is None or any(isinstance(criterion, StopStringCriteria) for criterion in criteria):
        return criteria
    return StoppingCriteriaList([*criteria, StopStringCriteria(call.tokenizer, call.stop_strings)])


def _decode_plainly(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool,
    call: SpeculationCall,
    config: SpeculationConfig,
    verifier: str,
    model_kwargs: dict[str, Any],
    why: str = "the plan is the root alone",
    price: str = "",
) -> torch.LongTensor | SpeculativeDecoderOnlyOutput:
    """No tree pays (`why`: the plan is the root alone on this hardware, the call is priced losing (`price`), or a
    batch's call is priced or measured losing): run Transformers' own decoding loop, so the output is plain
    `generate`'s bit for bit in any dtype, and say so in the stats."""
    start = time.perf_counter()
    out = model._sample(input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                        generation_config=generation_config, synced_gpus=synced_gpus, streamer=call.streamer,
                        **model_kwargs)
    if not generation_config.return_dict_in_generate:
        return out
    new_tokens = out.sequences.shape[1] - input_ids.shape[1]
    seconds = time.perf_counter() - start
    stats = SpeculationStats(
        method=config.method, verifier=verifier, plan_source=f"{config.plan_source}; {why}, so this call decoded "
        "plainly", target_forwards=new_tokens, new_tokens=new_tokens,
        tokens_per_step=[1] * new_tokens, time_total=seconds, time_verifying=seconds, time_target_forward=seconds,
        call_price=price,
    )
    fields = {field.name: getattr(out, field.name) for field in dataclasses.fields(out)}
    return SpeculativeDecoderOnlyOutput(**fields, speculation_stats=stats)


def install() -> None:
    """Route `generate(..., speculation=...)` through hf_specdec, and keep `speculation` in loaded generation
    configs. Idempotent."""
    GenerationMixin.generate = generate
    keep_field_on_load(True)


def uninstall() -> None:
    """Restore Transformers' own `generate` and `GenerationConfig.from_dict`."""
    GenerationMixin.generate = _ORIGINAL_GENERATE
    keep_field_on_load(False)
