"""The speculative loop: draft a tree, verify it in one target pass, keep the accepted path, repeat."""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters
from transformers import Cache, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.modeling_outputs import ModelOutput

from ..accept.emit import BlockStops
from ..accept.kv_cache import cache_length, crop, is_static, keep_positions, keeps_state, layer_rows, record_states
from ..core.drafter import Drafter
from ..core.model_inputs import TokenInputs
from ..core.verdict import Verifier
from ..runtime.attention import AttentionLayout
from ..runtime.device_copies import DeviceCopies, one_pass
from ..runtime.devices import PassClock, compute_devices, execution_device
from ..runtime.faster_call import FasterCall, compile_events
from ..runtime.pass_shapes import PassShapes, depth_first
from ..runtime.ranks import Ranks
from .outputs import TokenRecords
from .stats import SpeculationStats
from .step import chain_pass, fit_positions, judge, lean_target, prompt_pass, record_step, renumbered, tree_pass


@dataclass
class LoopResult:
    sequences: torch.LongTensor
    records: TokenRecords  # what return_dict_in_generate keeps per new token
    stats: SpeculationStats


def committed_on_error(loop: Callable[..., LoopResult]) -> Callable[..., LoopResult]:
    """Wrap the loop so that an exception anywhere in it (a processor, a stopping criterion, a streamer, an
    interrupt) leaves the caller's cache as plain `generate` would: the committed tokens only, never tree rows."""
    signature = inspect.signature(loop)

    @functools.wraps(loop)
    def run(*args, **kwargs) -> LoopResult:
        call = signature.bind(*args, **kwargs)
        stats = call.arguments["stats"] = call.arguments.get("stats") or SpeculationStats()
        counted = stats.new_tokens  # the loop counts a step's tokens once they are compacted into the cache
        try:
            return loop(*call.args, **call.kwargs)
        except BaseException:
            committed = call.arguments["input_ids"].shape[1] + stats.new_tokens - counted
            keep_committed(call.arguments["cache"], committed - 1, call.arguments["target"])
            raise

    return run


def keep_committed(cache: Cache, length: int, target: PreTrainedModel) -> None:
    """Crop `cache` to its first `length` rows, or to fewer when a pass stopped half way left some layer shorter
    (or not yet created), so that every layer holds the same committed tokens. A recurrent state rolls back as far
    as its recorded states reach (the last compaction): a pass stopped half way leaves it as it is."""
    if keeps_state(cache):
        with contextlib.suppress(IndexError, RuntimeError):
            crop(cache, min(length, cache_length(cache)))
        return
    rows = [layer_rows(layer) for layer in cache.layers]
    if len(rows) < target.config.get_text_config().num_hidden_layers:
        rows.append(0)  # a layer the interrupted pass never reached: the next pass creates it from position 0
    crop(cache, min([length, *rows]))


@committed_on_error
def speculative_loop(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    drafter: Drafter,
    verifier: Verifier,
    cache: Cache,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    streamer: BaseStreamer | None = None,
    generator: torch.Generator | None = None,
    records: TokenRecords | None = None,
    stats: SpeculationStats | None = None,
    model_kwargs: dict | None = None,
    token_inputs: TokenInputs | None = None,
    ranks: Ranks | None = None,
    forward: Callable[..., ModelOutput] | None = None,
    lean: bool | None = None,
    depth_first_order: bool | None = None,
) -> LoopResult:
    """Decode until a stopping criterion fires on some token; batch size 1.

    The target cache holds every committed token but the last one, which is the next tree's root (between the
    prompt's pass and the first step's, the root's row too: a plain first step runs no pass), and keeps all its rows
    (`accept.kv_cache.full_length_cache`): sliding windows are applied by the tree masks. `model_kwargs` are the
    call's model inputs as Transformers prepared them: the prefill takes them all, as plain's first pass
    does; tree passes take `token_inputs` (see `core.model_inputs`), which the drafter gets too. On a target
    sharded over `ranks`, only the deciding rank drafts and verifies; the others receive its tree and verdict.
    `forward` runs the tree passes (a compiled `target.__call__`; default the target itself); the prefill always
    runs eagerly, as in plain `generate`. On a static cache tree passes are padded to fixed shapes (`pass_shapes`).
    A target with recurrent state verifies chains (`chain_pass`) and rolls its state back to the accepted prefix.
    `lean` and `depth_first_order` are the config's `lean_target` and `depth_first` settings (None: the device
    decides).
    """
    stats = stats or SpeculationStats()
    records = records or TokenRecords()
    token_inputs = token_inputs or TokenInputs()
    start = time.perf_counter()
    recurrent = keeps_state(cache)
    if recurrent:  # a pass keeps the state after each of its tokens: the most a step forwards, root included
        record_states(cache, drafter.num_drafting_tokens + 1)
    # the cache keeps the root's row until the first step runs a pass (a recurrent state rolls back once, here)
    root_row = not recurrent
    prefill = prompt_pass(target, input_ids, cache, model_kwargs or {}, records.wants_pass_outputs, root_row)
    stats.time_prefill = time.perf_counter() - start
    drafter.use_inputs(token_inputs)
    finished = False
    dtype, device = target.dtype, execution_device(target)  # fixed for the call: not looked up every step
    layout = AttentionLayout.of(target)
    stops = BlockStops.of(stopping_criteria)
    clock = PassClock(compute_devices(target))
    copies = DeviceCopies.of(target)  # a target split over devices: its mask placed once per device and pass
    ranks = ranks or Ranks.of(target)
    shapes = PassShapes(cache.layers[0].max_cache_len if is_static(cache) else None, stats.tree_pass_sizes)
    # no compiled call: off the CPU, eager tree passes take the lean pass where it computes the model's function
    forward = forward or lean_target(target, layout, copies=copies, ranks=ranks, use=lean,
                                     static=shapes.width is not None,
                                     pass_outputs=records.wants_pass_outputs, token_inputs=token_inputs)
    graphs = counters["stats"]["unique_graphs"]  # what dynamo compiled before this call
    while not finished:
        # 1. the drafter proposes a tree rooted at the last committed token (on a sharded target: the deciding rank's)
        t0 = time.perf_counter()
        drafted = ranks.tree(drafter.propose(input_ids) if ranks.deciding else None, device)
        t1 = time.perf_counter()

        # 2. one target pass over the tree, cut to the positions and cache rows it may use; none for a plain
        # first step, whose token and row the prompt's pass gave
        past = input_ids.shape[1] - 1
        tree, kept = depth_first(*fit_positions(drafted, layout, past, target, shapes.rows(past)), device,
                                 depth_first_order)
        passless = root_row and len(tree) == 1
        if root_row and not passless:
            crop(cache, past)  # the tree's pass writes the root's row again
        root_row = False
        timed, compiled_before = clock.total, compile_events(forward)
        if passless:
            output, logits = prefill, prefill.logits[0, -1:]
        else:
            clock.start()
            with one_pass(copies):
                if recurrent:
                    output = chain_pass(target, tree, cache, device)
                else:
                    output = tree_pass(target, tree, past, cache, layout, dtype, device, token_inputs,
                                       records.wants_pass_outputs, shapes, forward)
            logits = output.logits[0, : len(tree)]
            clock.stop()
        compiling = compile_events(forward) != compiled_before  # a compiling pass (or a trial) is not a pass's time
        # 3. every node's row processed as plain `generate` would at that node, the verifier's verdict, and
        # 4. the accepted path and the bonus token emitted, stopping where a criterion fires; the cache keeps them
        first_step = prefill is not None  # its first token as plain generate computes it (see step.prompt_pass)
        (judged,) = judge(verifier, [tree], [logits], [input_ids], [logits_processor],
                          stopping_criteria, stops, device, generator,
                          first=[prefill.logits[0, -1:]] if first_step else None, ranks=ranks)
        t2 = time.perf_counter()
        seconds = clock.total - timed  # asked after the verdict's read: on a GPU, asking waits for the pass
        stats.time_target_forward += seconds
        if not compiling and not passless:
            drafter.observe_target_pass(len(tree), seconds)
        logits, scores, verdict, block = judged.logits, judged.scores, judged.verdict, judged.block
        input_ids, emitted, finished, path = judged.sequence, judged.emitted, judged.finished, judged.verdict.path
        for j, node in enumerate(path[:emitted] if records.wants_any else ()):
            if first_step and j == 0:  # the root's position was computed by the prompt's pass
                records.add(scores[node], logits[node], prefill)
            else:
                records.add(scores[node], logits[node], output, node, past, path[: j + 1], layout)
        # Keep the path up to the last emitted token's parent: when a stop fires inside the accepted block, the
        # cache (returned with return_dict_in_generate) then holds exactly the sequence but its last token, as
        # plain generate's does, and a chat continued from it sees no token past the stop.
        keep_positions(cache, past, [past + node for node in path[:emitted]])
        if streamer is not None:
            streamer.put(torch.tensor(block[:emitted]))
        # 5. the drafter learns the verdict; the step's stats
        if not finished and ranks.deciding:
            drafter.accept(input_ids, drafted, verdict if kept is None else renumbered(verdict, kept))
        record_step(stats, tree, verdict, emitted, passed=not passless)
        prefill = None
        stats.time_drafting += t1 - t0
        stats.time_verifying += t2 - t1
    stats.graphs_compiled = counters["stats"]["unique_graphs"] - graphs
    stats.draft_pass_sizes = set(drafter.draft_pass_sizes)
    stats.sizes_kept_eager = forward.kept_eager() & stats.tree_pass_sizes if isinstance(forward, FasterCall) else set()
    stats.draft_sizes_kept_eager = set(drafter.draft_sizes_kept_eager)
    stats.draft_forwards = drafter.forward_count
    stats.shrunk_steps, stats.size_probes = drafter.shrunk_steps, drafter.size_probes
    stats.deepened_levels = drafter.deepened_levels
    stats.time_draft_forward = drafter.forward_time
    stats.time_total = time.perf_counter() - start
    if streamer is not None:
        streamer.end()
    return LoopResult(sequences=input_ids, records=records, stats=stats)


