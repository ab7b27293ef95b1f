"""The speculative loop: draft a tree, verify it in one target pass, keep the accepted path, repeat."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import Cache, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria
from transformers.generation.streamers import BaseStreamer

from ..core.attention import AttentionLayout
from ..core.devices import PassClock, execution_device
from ..core.drafter import Drafter
from ..core.kv_cache import cache_length, crop, keep_positions
from ..core.processing import NodeScores, process_tree_scores
from ..core.tree import TokenTree
from ..core.verdict import Verdict, Verifier
from .stats import SpeculationStats


@dataclass
class LoopResult:
    sequences: torch.LongTensor
    scores: list[torch.Tensor]  # processed scores of each new token's position, (1, vocab)
    logits: list[torch.Tensor]  # raw logits of each new token's position, (1, vocab)
    stats: SpeculationStats


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
    keep_scores: bool = False,
    keep_logits: bool = False,
    stats: SpeculationStats | None = None,
) -> LoopResult:
    """Decode until a stopping criterion fires on some token; batch size 1.

    The target cache always holds every committed token but the last one, which is the next tree's root, and keeps
    all its rows (`core.kv_cache.full_length_cache`): sliding windows are applied by the tree masks.
    """
    stats = stats or SpeculationStats()
    start = time.perf_counter()
    root_logits = _prefill(target, input_ids, cache)
    stats.time_prefill = time.perf_counter() - start
    scores_out, logits_out = [], []
    finished = False
    dtype, device = target.dtype, execution_device(target)  # fixed for the call: not looked up every step
    layout = AttentionLayout.of(target)
    stops = BlockStops.of(stopping_criteria)
    clock = PassClock(device)
    while not finished:
        t0 = time.perf_counter()
        drafted = drafter.propose(input_ids)
        t1 = time.perf_counter()

        past = input_ids.shape[1] - 1
        tree, kept = fit_positions(drafted, layout, past, target)
        timed = clock.total
        clock.start()
        logits = tree_logits(target, tree, past, cache, layout, dtype, device)
        clock.stop()
        seconds = clock.total - timed
        stats.time_target_forward += seconds
        drafter.observe_target_pass(len(tree), seconds)
        if root_logits is not None:  # the first token as plain generate computes it (see _prefill)
            logits, root_logits = torch.cat([root_logits.to(logits.dtype), logits[1:]]), None
        # a walking verifier reads a few nodes: their rows are processed when it reads them, the others never
        score_rows = NodeScores if getattr(verifier, "walks", False) else process_tree_scores
        scores = score_rows(logits_processor, input_ids[:, :-1].to(device), tree, logits)
        verdict = verifier.verify(tree, scores, generator)
        t2 = time.perf_counter()

        path = verdict.path
        block = [tree.host(tokens=True).tokens[node] for node in path[1:]] + [verdict.bonus_token]
        input_ids, emitted, finished = emit(input_ids, block, scores[path], stopping_criteria, stops)
        if keep_scores:
            scores_out.extend(scores[node][None] for node in path[:emitted])
        if keep_logits:
            logits_out.extend(logits[node][None].float() for node in path[:emitted])
        # Keep the path up to the last emitted token's parent: when a stop fires inside the accepted block, the
        # cache (returned with return_dict_in_generate) then holds exactly the sequence but its last token, as
        # plain generate's does, and a chat continued from it sees no token past the stop.
        keep_positions(cache, past, [past + node for node in path[:emitted]])
        if streamer is not None:
            streamer.put(torch.tensor(block[:emitted]))
        if not finished:
            drafter.accept(input_ids, drafted, verdict if kept is None else _renumbered(verdict, kept))
        _record(stats, tree, verdict, emitted)
        stats.time_drafting += t1 - t0
        stats.time_verifying += t2 - t1
    stats.draft_forwards = drafter.forward_count
    stats.time_draft_forward = drafter.forward_time
    stats.time_total = time.perf_counter() - start
    if streamer is not None:
        streamer.end()
    return LoopResult(sequences=input_ids, scores=scores_out, logits=logits_out, stats=stats)


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


def _prefill(target: PreTrainedModel, input_ids: torch.LongTensor, cache: Cache) -> torch.Tensor:
    """Feed the prompt tokens the cache lacks in one pass, as plain `generate` does, and return the logits `(1, vocab)`
    of the last one: they decide the first new token, which then equals plain's in any dtype (a tree pass computes
    the same position with other matrix shapes, which in half precision round differently). The last token is then
    dropped from the cache again: it is the first tree's root, which the loop feeds with its tree."""
    if cache_length(cache) >= input_ids.shape[1]:  # a cache holding the whole prompt: recompute its last token
        crop(cache, input_ids.shape[1] - 1)
    device = execution_device(target)
    logits = target(input_ids=input_ids[:, cache_length(cache) :].to(device), past_key_values=cache, use_cache=True,
                    logits_to_keep=1).logits[0]
    crop(cache, input_ids.shape[1] - 1)
    return logits


def tree_logits(
    target: PreTrainedModel,
    tree: TokenTree,
    past: int,
    cache: Cache,
    layout: AttentionLayout,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Logits `(n, vocab)` of one target pass over `tree` after `past` cached tokens: each node sees its ancestors
    (and, in sliding-window layers, only keys less than a window behind it) at position past + its depth. Masks
    and position ids are built on the target's device."""
    tree = tree.to(device)
    return target(
        input_ids=tree.tokens[None].to(device),
        attention_mask=layout.tree_masks(tree, past, dtype, device),
        position_ids=tree.position_ids(past).to(device),
        past_key_values=cache,
        use_cache=True,
    ).logits[0]


def fit_positions(
    tree: TokenTree, layout: AttentionLayout, past: int, target: PreTrainedModel
) -> tuple[TokenTree, torch.Tensor | None]:
    """`tree` without the nodes past the end of a learned position table, and the kept nodes (None: all kept).

    Dropping whole levels leaves every kept node's children intact or empty, so any verifier stays exact.
    At the table's very end nothing fits, as in plain `generate`, which fails on the same token.
    """
    deepest = layout.deepest_node(past)
    if deepest is None or tree.max_depth <= deepest:
        return tree, None
    if deepest < 0:
        raise IndexError(
            f"{type(target).__name__} has learned positions 0..{layout.position_limit - 1} only, and the next token "
            f"needs position {past}: plain generate fails here too. Ask for at most "
            f"max_length={layout.position_limit + 1} tokens (prompt included)."
        )
    kept = torch.nonzero(tree.depths <= deepest).flatten()
    return tree.select(kept), kept


def _renumbered(verdict: Verdict, kept: torch.Tensor) -> Verdict:
    """A verdict on `tree.select(kept)` in the numbering of the whole tree (what the drafter proposed)."""
    return Verdict(path=kept[verdict.path].tolist(), bonus_token=verdict.bonus_token,
                   accepted_ranks=verdict.accepted_ranks)


def _record(stats: SpeculationStats, tree, verdict, emitted: int) -> None:
    stats.target_forwards += 1
    stats.drafted_tokens += len(tree) - 1
    stats.new_tokens += emitted
    stats.tokens_per_step.append(emitted)
    children = tree.host().children()
    for depth, node in enumerate(verdict.path):
        if children[node]:
            stats.reached_depths[depth] += 1
            if depth < len(verdict.accepted_ranks):
                stats.accepted_ranks[(depth, verdict.accepted_ranks[depth])] += 1
