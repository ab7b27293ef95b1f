"""The parts of one speculative step, shared by the loop over one sequence (`loop.py`) and over a batch
(`batch_loop.py`): the prompt's pass as plain `generate` makes it, the tree cut to the positions and rows it may use,
the target's pass over a tree (or a chain, on recurrent state) and the lean forward its eager tree passes may take,
the verdicts and the tokens they emit (`judge`: the same for one sequence and a batch's rows), a verdict renumbered
to the drafted tree, and the step's stats. What differs between the loops is where the rows sit in the target's
cache: one sequence's tree after its committed tokens, or a batch's ragged rows (`accept.ragged`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import Cache, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput

from ..accept.emit import BlockStops, block_scores, emit_rows
from ..accept.kv_cache import cache_length, crop
from ..core.model_inputs import TokenInputs
from ..core.releases import CACHE, cache_arg
from ..core.tree import TokenTree
from ..core.verdict import Verdict, Verifier
from ..kernels.lean_pass import LeanPass
from ..logits.processing import NodeScores, process_tree_scores
from ..runtime.attention import AttentionLayout, Masks
from ..runtime.device_copies import DeviceCopies
from ..runtime.devices import execution_device
from ..runtime.pass_shapes import PassShapes, fit_tree, padded_pass
from ..runtime.ranks import Ranks
from .stats import SpeculationStats


def prompt_pass(
    target: PreTrainedModel, input_ids: torch.LongTensor, cache: Cache, model_kwargs: dict, pass_outputs: bool,
    keep_root: bool = False,
) -> ModelOutput:
    """Plain `generate`'s first pass, built by the model's own `prepare_inputs_for_generation` from every input of
    the call (images, token types, ...): the prompt tokens the cache lacks. Its last logits decide the first new
    token, which then equals plain's in any dtype (a tree pass computes the same position with other matrix shapes,
    which in half precision round differently). The last token is then dropped from the cache again: it is the first
    tree's root, which the loop feeds with its tree. `keep_root` keeps its row instead, for a loop that crops it
    only when its first step runs a pass (a plain first step needs none: this pass gave its token and its row)."""
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
    if not keep_root:
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
        tokens, positions = tree.input_tokens[None], tree.position_ids(past)
        masks = layout.tree_masks(tree, past, dtype, device)
    else:
        padded = padded_pass(tree, past, shapes, layout, dtype, device)
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
    return target(input_ids=tree.input_tokens[None].to(device), **cache_arg(cache), use_cache=True, return_dict=True)


def lean_target(
    target: PreTrainedModel,
    layout: AttentionLayout,
    *,
    copies: DeviceCopies | None,
    ranks: Ranks,
    use: bool | None = None,
    static: bool = False,
    pass_outputs: bool = False,
    token_inputs: TokenInputs | None = None,
) -> Callable[..., ModelOutput] | None:
    """The target's eager tree passes through the lean pass (`draft.lean_pass`), called as its forward is (the
    inputs a tree pass gives, nothing else), or None where they keep the forward. `use`: the `lean_target` setting
    (None: off the CPU only).

    Why: on a GPU an eager pass of a 7B target is bound by its host time (about 20 ms over one token on an H200,
    where its matmuls take a few), and most of that is the wrapper's Python and ops the lean pass does not run. It
    computes the model's function (tested against the forward to float32 rounding, as a tree pass's other shapes
    already differ from plain's single-row passes in their last bits) for an sdpa target on one device, in one
    process, with nothing but token ids asked of the pass: a padded call (static cache), hidden states or attentions
    to return, per-token inputs, another attention or a split target keep the forward. A batch's passes take it too.
    """
    use = use if use is not None else execution_device(target).type != "cpu"
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


@dataclass
class Judged:
    """One row's step once the target has scored its tree: the tree's logits and processed scores (what output
    records keep), the verdict, the tokens it emits (the accepted path's, then the bonus token) and the row's
    sequence with those of them that went in (`emitted`, fewer where a stopping criterion fired: `finished`)."""

    logits: torch.Tensor
    scores: torch.Tensor | NodeScores
    verdict: Verdict
    block: list[int]
    sequence: torch.LongTensor
    emitted: int
    finished: bool


def judge(
    verifier: Verifier,
    trees: list[TokenTree],
    logits: list[torch.Tensor],
    sequences: list[torch.LongTensor],
    processors: list[LogitsProcessorList],
    criteria: StoppingCriteriaList,
    stops: BlockStops,
    device: torch.device,
    generator: torch.Generator | None = None,
    first: list[torch.Tensor] | None = None,
    ranks: Ranks | None = None,
) -> list[Judged]:
    """Steps 3 and 4 of a step, for one sequence or a batch's rows: each row's tree `logits` `(n, V)` processed as
    plain `generate` would at each node (the row's `processors` over its `sequences` `(1, L)`, whose last token is
    the tree's root, moved to the target's `device`), the verifier's verdicts, and each row's accepted path and bonus
    token emitted up to where its stopping criteria fire (`accept.emit.emit_rows`).

    `first`: on the first step, each row's logits of the prompt's last position from the prompt's pass (`(1, V)`),
    which decide the first token as plain `generate` computes it (see `prompt_pass`). One sequence (`ranks` given) is
    verified by `verify`, which may read a level at a time and stop early, its verdict decided on the deciding rank
    of a sharded target and handed to the others; a batch's rows by `verify_rows` (greedy: one read for every row).
    A walking verifier reads a few nodes: their rows are processed when it reads them, the others never."""
    if first is not None:
        logits = [torch.cat([row_first.to(row.dtype), row[1:]]) for row_first, row in zip(first, logits)]
    score_rows = NodeScores if verifier.walks else process_tree_scores
    scores = [score_rows(row_processors, sequence[:, :-1].to(device), tree, row_logits)
              for row_processors, sequence, tree, row_logits in zip(processors, sequences, trees, logits)]
    if ranks is not None:
        tree = trees[0]
        verdicts = [ranks.verdict(verifier.verify(tree, scores[0], generator) if ranks.deciding else None, tree)]
    else:
        verdicts = verifier.verify_rows(trees, scores, generator)
    blocks = [[tree.host(tokens=True).tokens[node] for node in verdict.path[1:]] + [verdict.bonus_token]
              for tree, verdict in zip(trees, verdicts)]  # the verifiers' read brought the tokens (no read here)
    verdicts = [dataclasses.replace(verdict, tokens=block) for verdict, block in zip(verdicts, blocks)]
    emitted = emit_rows([(sequence, block, block_scores(row_scores, verdict.path, stops))
                         for sequence, block, row_scores, verdict in zip(sequences, blocks, scores, verdicts)],
                        criteria, stops)
    return [Judged(row_logits, row_scores, verdict, block, *row_emitted)
            for row_logits, row_scores, verdict, block, row_emitted in zip(logits, scores, verdicts, blocks, emitted)]


def renumbered(verdict: Verdict, kept: list[int]) -> Verdict:
    """A verdict on `tree.select(kept)` in the numbering of the whole tree (what the drafter proposed)."""
    return dataclasses.replace(verdict, path=[kept[node] for node in verdict.path])


def record_step(stats: SpeculationStats, tree, verdict, emitted: int, passed: bool = True) -> None:
    """`passed`: False for a plain first step that took its token from the prompt's pass (not a target pass)."""
    stats.target_forwards += passed
    host = tree.host()
    stats.drafted_tokens += len(tree) - 1 if host.tokens is None else sum(token >= 0 for token in host.tokens[1:])
    stats.new_tokens += emitted
    stats.tokens_per_step.append(emitted)
    stats.plain_steps += len(tree) == 1
    children = host.children()
    for depth, node in enumerate(verdict.path):
        if children[node]:
            stats.reached_depths[depth] += 1
            if depth < len(verdict.accepted_ranks):
                stats.accepted_ranks[(depth, verdict.accepted_ranks[depth])] += 1
