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
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput

from ..accept.emit import BlockStops, block_scores, emit
from ..accept.kv_cache import cache_length, crop, is_static, keep_positions, keeps_state, layer_rows, record_states
from ..core.drafter import Drafter
from ..core.model_inputs import TokenInputs
from ..core.releases import CACHE, cache_arg
from ..core.tree import TokenTree
from ..core.verdict import Verdict, Verifier
from ..kernels.lean_pass import LeanPass
from ..logits.processing import NodeScores, process_tree_scores
from ..runtime.attention import AttentionLayout, Masks
from ..runtime.device_copies import DeviceCopies, one_pass
from ..runtime.devices import PassClock, compute_devices, execution_device
from ..runtime.faster_call import FasterCall, compile_events
from ..runtime.pass_shapes import PassShapes, depth_first, fit_tree, padded_pass
from ..runtime.ranks import Ranks
from .outputs import TokenRecords
from .stats import SpeculationStats

#: whether the target's eager tree passes take the lean pass where it computes the model's function
#: (`lean_target`); None: off the CPU only, where a pass's host time is mostly launches (see `lean_target`)
LEAN_TARGET: bool | None = None


@dataclass
class LoopResult:
    sequences: torch.LongTensor
    records: TokenRecords  # what return_dict_in_generate keeps per new token
    stats: SpeculationStats


def _committed_on_error(loop: Callable[..., LoopResult]) -> Callable[..., LoopResult]:
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


@_committed_on_error
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
) -> LoopResult:
    """Decode until a stopping criterion fires on some token; batch size 1.

    The target cache always holds every committed token but the last one, which is the next tree's root, and keeps
    all its rows (`accept.kv_cache.full_length_cache`): sliding windows are applied by the tree masks. `model_kwargs`
    are the call's model inputs as Transformers prepared them: the prefill takes them all, as plain's first pass
    does; tree passes take `token_inputs` (see `core.model_inputs`), which the drafter gets too. On a target
    sharded over `ranks`, only the deciding rank drafts and verifies; the others receive its tree and verdict.
    `forward` runs the tree passes (a compiled `target.__call__`; default the target itself); the prefill always
    runs eagerly, as in plain `generate`. On a static cache tree passes are padded to fixed shapes (`pass_shapes`).
    A target with recurrent state verifies chains (`chain_pass`) and rolls its state back to the accepted prefix.
    """
    stats = stats or SpeculationStats()
    records = records or TokenRecords()
    token_inputs = token_inputs or TokenInputs()
    start = time.perf_counter()
    recurrent = keeps_state(cache)
    if recurrent:  # a pass keeps the state after each of its tokens: the most a step forwards, root included
        record_states(cache, drafter.num_drafting_tokens + 1)
    prefill = _prefill(target, input_ids, cache, model_kwargs or {}, records.wants_pass_outputs)
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
    forward = forward or lean_target(target, layout, copies=copies, ranks=ranks, static=shapes.width is not None,
                                     pass_outputs=records.wants_pass_outputs, token_inputs=token_inputs)
    graphs = counters["stats"]["unique_graphs"]  # what dynamo compiled before this call
    while not finished:
        t0 = time.perf_counter()
        drafted = ranks.tree(drafter.propose(input_ids) if ranks.deciding else None, device)
        t1 = time.perf_counter()

        past = input_ids.shape[1] - 1
        tree, kept = depth_first(*fit_positions(drafted, layout, past, target, shapes.rows(past)), device)
        timed, compiled_before = clock.total, compile_events(forward)
        clock.start()
        with one_pass(copies):
            if recurrent:
                output = chain_pass(target, tree, cache, device)
            else:
                output = tree_pass(target, tree, past, cache, layout, dtype, device, token_inputs,
                                   records.wants_pass_outputs, shapes, forward)
        logits = output.logits[0, : len(tree)]
        clock.stop()
        seconds = clock.total - timed
        stats.time_target_forward += seconds
        if compile_events(forward) == compiled_before:  # a compiling pass (or a trial) is not a pass's time
            drafter.observe_target_pass(len(tree), seconds)
        first_step = prefill is not None
        if first_step:  # the first token as plain generate computes it (see _prefill)
            logits = torch.cat([prefill.logits[0, -1:].to(logits.dtype), logits[1:]])
        # a walking verifier reads a few nodes: their rows are processed when it reads them, the others never
        score_rows = NodeScores if getattr(verifier, "walks", False) else process_tree_scores
        scores = score_rows(logits_processor, input_ids[:, :-1].to(device), tree, logits)
        verdict = ranks.verdict(verifier.verify(tree, scores, generator) if ranks.deciding else None, tree)
        t2 = time.perf_counter()

        path = verdict.path
        block = [tree.host(tokens=True).tokens[node] for node in path[1:]] + [verdict.bonus_token]
        input_ids, emitted, finished = emit(input_ids, block, block_scores(scores, path, stops), stopping_criteria,
                                            stops)
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
        if not finished and ranks.deciding:
            drafter.accept(input_ids, drafted, verdict if kept is None else _renumbered(verdict, kept))
        _record(stats, tree, verdict, emitted)
        prefill = None
        stats.time_drafting += t1 - t0
        stats.time_verifying += t2 - t1
    stats.graphs_compiled = counters["stats"]["unique_graphs"] - graphs
    stats.draft_pass_sizes = set(getattr(drafter, "draft_pass_sizes", ()))
    stats.sizes_kept_eager = forward.kept_eager() & stats.tree_pass_sizes if isinstance(forward, FasterCall) else set()
    stats.draft_sizes_kept_eager = set(getattr(drafter, "draft_sizes_kept_eager", ()))
    stats.draft_forwards = drafter.forward_count
    stats.shrunk_steps = getattr(drafter, "shrunk_steps", 0)
    stats.time_draft_forward = drafter.forward_time
    stats.time_total = time.perf_counter() - start
    if streamer is not None:
        streamer.end()
    return LoopResult(sequences=input_ids, records=records, stats=stats)


def _prefill(
    target: PreTrainedModel, input_ids: torch.LongTensor, cache: Cache, model_kwargs: dict, pass_outputs: bool
) -> ModelOutput:
    """Plain `generate`'s first pass, built by the model's own `prepare_inputs_for_generation` from every input of
    the call (images, token types, ...): the prompt tokens the cache lacks. Its last logits decide the first new
    token, which then equals plain's in any dtype (a tree pass computes the same position with other matrix shapes,
    which in half precision round differently). The last token is then dropped from the cache again: it is the first
    tree's root, which the loop feeds with its tree."""
    if cache_length(cache) >= input_ids.shape[1]:  # a cache holding the whole prompt: recompute its last token
        crop(cache, input_ids.shape[1] - 1)
    kwargs = {**model_kwargs, **cache_arg(cache), "use_cache": True}
    if pass_outputs:  # what plain's first entry of hidden states / attentions holds
        kwargs.update(output_hidden_states=bool(kwargs.get("output_hidden_states")),
                      output_attentions=bool(kwargs.get("output_attentions")))
    inputs = target.prepare_inputs_for_generation(
        input_ids, next_sequence_length=input_ids.shape[1] - cache_length(cache), is_first_iteration=True, **kwargs
    )
    output = target(**inputs, return_dict=True)
    crop(cache, input_ids.shape[1] - 1)
    return output


def tree_pass(
    target: PreTrainedModel,
    tree: TokenTree,
    past: int,
    cache: Cache,
    layout: AttentionLayout,
    dtype: torch.dtype,
    device: torch.device,
    token_inputs: TokenInputs | None = None,
    pass_outputs: bool = False,
    shapes: PassShapes | None = None,
    forward: Callable[..., ModelOutput] | None = None,
) -> ModelOutput:
    """One target pass over `tree` after `past` cached tokens (logits `(1, n, vocab)`, or more rows when `shapes`
    pads the tree: the first n are the nodes'): each node sees its ancestors (and, in sliding-window layers, only
    keys less than a window behind it) at position past + its depth. `token_inputs` places per-token inputs at the
    nodes' positions; `pass_outputs` asks for hidden states and attentions too. Masks are built on the host and
    copied once, position ids on the target's device; `forward` (default `target`; a compiled call, or the lean
    pass of `lean_target`) runs the pass."""
    flags = {"output_hidden_states": True, "output_attentions": True} if pass_outputs else {}
    tree = tree.to(device)
    width = shapes.width if shapes is not None else None
    if width is None:
        tokens, positions = tree.tokens[None], tree.position_ids(past)
        masks = layout.tree_masks(tree, past, dtype, device)
    else:
        padded = padded_pass(tree, past, shapes.size(len(tree)), width, layout, dtype, device)
        tokens, positions, masks = padded.tokens, padded.positions, padded.masks
    extra = token_inputs.at(positions, device) if token_inputs is not None and token_inputs.prompt else {}
    return (forward or target)(
        input_ids=tokens.to(device),
        attention_mask=masks,
        position_ids=positions.to(device),
        **cache_arg(cache),
        use_cache=True,
        return_dict=True,
        **extra,
        **flags,
    )


def chain_pass(target: PreTrainedModel, tree: TokenTree, cache: Cache, device: torch.device) -> ModelOutput:
    """One target pass over `tree`, a chain, on a model with recurrent state: a plain causal pass over its tokens (the
    model places them after the cache's and builds its own masks, as for any later pass of plain `generate`)."""
    if tree.host().depths()[-1] != len(tree) - 1:
        raise ValueError("A target with recurrent state verifies chains only (one drafted token per level).")
    return target(input_ids=tree.tokens[None].to(device), **cache_arg(cache), use_cache=True, return_dict=True)


def lean_target(
    target: PreTrainedModel,
    layout: AttentionLayout,
    *,
    copies: DeviceCopies | None,
    ranks: Ranks,
    static: bool = False,
    pass_outputs: bool = False,
    token_inputs: TokenInputs | None = None,
) -> Callable[..., ModelOutput] | None:
    """The target's eager tree passes through the lean pass (`draft.lean_pass`), called as its forward is (the
    inputs a tree pass gives, nothing else), or None where they keep the forward.

    Why: on a GPU an eager pass of a 7B target is bound by its host time (about 20 ms over one token on an H200,
    where its matmuls take a few), and most of that is the wrapper's Python and ops the lean pass does not run. It
    computes the model's function (tested against the forward to float32 rounding, as a tree pass's other shapes
    already differ from plain's single-row passes in their last bits) for an sdpa target on one device, in one
    process, with nothing but token ids asked of the pass: a padded call (static cache), hidden states or attentions
    to return, per-token inputs, another attention or a split target keep the forward. A batch's passes take it too.
    """
    use = LEAN_TARGET if LEAN_TARGET is not None else execution_device(target).type != "cpu"
    extra = token_inputs is not None and bool(token_inputs.prompt)
    if (not use or static or pass_outputs or extra or copies is not None or ranks.shared
            or target.config._attn_implementation != "sdpa"):
        return None
    lean = LeanPass.of(target, layout.layer_types)
    if lean is None:
        return None

    def forward(input_ids: torch.Tensor, attention_mask: Masks, position_ids: torch.Tensor, use_cache: bool = True,
                return_dict: bool = True, **cache: Cache) -> ModelOutput:
        if list(cache) != [CACHE]:  # any other input would go unhonoured
            raise TypeError(f"The lean pass takes the cache ({CACHE}=) beside its inputs, and was given {list(cache)}.")
        return CausalLMOutputWithPast(logits=lean(input_ids, position_ids, attention_mask, cache[CACHE]))

    return forward


def fit_positions(
    tree: TokenTree, layout: AttentionLayout, past: int, target: PreTrainedModel, rows: int | None = None
) -> tuple[TokenTree, list[int] | None]:
    """`tree` without the nodes past the end of a learned position table, cut to at most `rows` nodes (what a
    static cache can still take), and the kept nodes (None: all kept).

    Dropping whole levels leaves every kept node's children intact or empty, so any verifier stays exact.
    At the table's very end nothing fits, as in plain `generate`, which fails on the same token.
    """
    deepest = layout.deepest_node(past)
    if deepest is not None and deepest < 0:
        raise IndexError(
            f"{type(target).__name__} has learned positions 0..{layout.position_limit - 1} only, and the next token "
            f"needs position {past}: plain generate fails here too. Ask for at most "
            f"max_length={layout.position_limit + 1} tokens (prompt included)."
        )
    return fit_tree(tree, past, deepest, rows)


def _renumbered(verdict: Verdict, kept: list[int]) -> Verdict:
    """A verdict on `tree.select(kept)` in the numbering of the whole tree (what the drafter proposed)."""
    return Verdict(path=[kept[node] for node in verdict.path], bonus_token=verdict.bonus_token,
                   accepted_ranks=verdict.accepted_ranks)


def _record(stats: SpeculationStats, tree, verdict, emitted: int) -> None:
    stats.target_forwards += 1
    stats.drafted_tokens += len(tree) - 1
    stats.new_tokens += emitted
    stats.tokens_per_step.append(emitted)
    stats.plain_steps += len(tree) == 1
    children = tree.host().children()
    for depth, node in enumerate(verdict.path):
        if children[node]:
            stats.reached_depths[depth] += 1
            if depth < len(verdict.accepted_ranks):
                stats.accepted_ranks[(depth, verdict.accepted_ranks[depth])] += 1
