"""How `speculation=` reaches the loop: a thin wrapper around `GenerationMixin.generate`.

The wrapper leaves every call without `speculation` untouched. With it, the call goes through
Transformers' own `generate` (input preparation, processors, stopping criteria, cache) with a
`custom_generate` callable: the speculative loop. Transformers hands a callable neither the assistant
nor the streamer, so both travel inside one `SpeculationCall` argument.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.utils import GenerationMixin

from ..calibration.plan_lookup import call_temperature, plan_for_call
from ..core.config import SpeculationConfig, make_config
from ..core.kv_cache import full_length_cache
from ..decoding.loop import speculative_loop
from ..decoding.outputs import SpeculativeDecoderOnlyOutput
from ..decoding.stats import SpeculationStats
from ..verification import verifier_for
from .generation_config import get_speculation
from .validation import check_call, check_generation_config, check_processors

_ORIGINAL_GENERATE = GenerationMixin.generate
_SIGNATURE = inspect.signature(_ORIGINAL_GENERATE)
SPECULATION_KWARGS = ("speculation", "speculation_config", "speculation_generator")


@dataclass
class SpeculationCall:
    """Everything the speculative loop needs that Transformers would not pass to a `custom_generate` callable."""

    config: SpeculationConfig
    assistant_model: PreTrainedModel | None
    streamer: Any
    generator: torch.Generator | None


def speculation_requested(model: PreTrainedModel, kwargs: dict[str, Any]) -> Any:
    """The `speculation` setting of this call: the kwarg, else the generation config's `speculation` field.

    A stored setting applies only when it can run: a method that drafts with a model needs `assistant_model`,
    so a saved model without one keeps generating plainly (pipelines included).
    """
    if kwargs.get("speculation") is not None:
        return kwargs["speculation"]
    stored = get_speculation(kwargs.get("generation_config") or getattr(model, "generation_config", None))
    if stored is None or (stored.needs_assistant and kwargs.get("assistant_model") is None):
        return None
    return stored


@functools.wraps(_ORIGINAL_GENERATE)
def generate(self, *args, **kwargs):
    """`GenerationMixin.generate`, plus `speculation=` (see hf_specdec's README)."""
    if kwargs.get("custom_generate") is not None:
        # Someone else's decoding loop (or hf_specdec's own Hub folder, which calls back into this function):
        # hand it every argument, `speculation` included.
        return _ORIGINAL_GENERATE(self, *args, **kwargs)
    if args:
        kwargs = {**_SIGNATURE.bind_partial(self, *args).arguments, **kwargs}
        kwargs.pop("self")
    speculation = speculation_requested(self, kwargs)
    options = {name: kwargs.pop(name, None) for name in SPECULATION_KWARGS}
    if speculation is None:
        given = [name for name, value in options.items() if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given without `speculation`: pass speculation=<method name> too.")
        return _ORIGINAL_GENERATE(self, **kwargs)
    config = _config_for_call(speculation, options["speculation_config"])
    call = SpeculationCall(
        config=config,
        assistant_model=kwargs.pop("assistant_model", None),
        streamer=kwargs.pop("streamer", None),
        generator=options["speculation_generator"],
    )
    check_call(self, call, kwargs)
    return _ORIGINAL_GENERATE(self, custom_generate=speculative_generate, speculation_call=call, **kwargs)


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
    check_generation_config(model, generation_config, input_ids, model_kwargs)
    check_processors(logits_processor)
    do_sample = bool(generation_config.do_sample)
    verifier = verifier_for(call.config, do_sample)
    config = call.config
    request = config.plan_request()
    if request is not None:  # look the plan up (given, stored, re-sized or calibrated now) before drafting
        plan, source = plan_for_call(request, model, call.assistant_model, call_temperature(generation_config),
                                     input_ids)
        config = config.with_plan(plan, source)
    if call.streamer is not None:
        call.streamer.put(input_ids.cpu())
    if not config.drafts():
        return _decode_plainly(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                               call, config, verifier.name, model_kwargs)
    cache = full_length_cache(model_kwargs.get("past_key_values"))  # sliding windows go into the tree masks
    drafter = config.make_drafter(
        model, call.assistant_model, logits_processor, verifier.child_selection, call.generator
    )
    stats = SpeculationStats(method=config.method, verifier=verifier.name, plan_source=config.plan_source)
    result = speculative_loop(
        model,
        input_ids,
        drafter,
        verifier,
        cache,
        logits_processor,
        stopping_criteria,
        streamer=call.streamer,
        generator=call.generator,
        keep_scores=bool(generation_config.return_dict_in_generate and generation_config.output_scores),
        keep_logits=bool(generation_config.return_dict_in_generate and generation_config.output_logits),
        stats=stats,
    )
    if not generation_config.return_dict_in_generate:
        return result.sequences
    return SpeculativeDecoderOnlyOutput(
        sequences=result.sequences,
        scores=tuple(result.scores) if generation_config.output_scores else None,
        logits=tuple(result.logits) if generation_config.output_logits else None,
        past_key_values=cache if generation_config.use_cache else None,
        speculation_stats=result.stats,
    )


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
) -> torch.LongTensor | SpeculativeDecoderOnlyOutput:
    """The plan is the root alone (no tree pays on this hardware): run Transformers' own decoding loop, so the
    output is plain `generate`'s bit for bit in any dtype, and say so in the stats."""
    start = time.perf_counter()
    out = model._sample(input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                        generation_config=generation_config, synced_gpus=synced_gpus, streamer=call.streamer,
                        **model_kwargs)
    if not generation_config.return_dict_in_generate:
        return out
    new_tokens = out.sequences.shape[1] - input_ids.shape[1]
    seconds = time.perf_counter() - start
    stats = SpeculationStats(
        method=config.method, verifier=verifier, plan_source=f"{config.plan_source}; the plan is the root alone, so "
        "this call decoded plainly", target_forwards=new_tokens, new_tokens=new_tokens,
        tokens_per_step=[1] * new_tokens, time_total=seconds, time_verifying=seconds, time_target_forward=seconds,
    )
    fields = {field.name: getattr(out, field.name) for field in dataclasses.fields(out)}
    return SpeculativeDecoderOnlyOutput(**fields, speculation_stats=stats)


def install() -> None:
    """Route `generate(..., speculation=...)` through hf_specdec. Idempotent."""
    GenerationMixin.generate = generate


def uninstall() -> None:
    """Restore Transformers' own `generate`."""
    GenerationMixin.generate = _ORIGINAL_GENERATE
