"""A speculative step captured whole: draft, verify and accept as device work of fixed shapes, read once (issue 72).

Why: on a GPU the loop of `loop.py` pays Python and kernel launches between its passes (21-24% of a `sequoia` step
on an H200, measured in `benchmarks/engine_launches.py`), which is what keeps it level with plain static-cache
compiled decoding. For a tree of one shape on static caches nothing in a greedy step needs the host: positions and
masks follow from the caches' write lengths (device scalars), the children from the draft's top-k, the verdict from
the target's argmax, and the compaction is an index copy of depth + 1 rows. So the step is one function of device
tensors (`CapturedStep`), which `torch.compile` can turn into one graph per shape (a CUDA graph with
`mode="reduce-overhead"`), and the host reads one small tensor a step: the accepted count, the bonus token, the
path and the drafted tokens, to emit, stream and stop (`captured_loop`).

One step (gpt-fast's rollback by position: rows past a cache's write length are stale, later writes overwrite them):
1. the draft catches up with the 1 or 2 committed tokens it has not read (the last step's unforwarded accepted leaf,
   if any, and its bonus token), fed as two rows whatever the count; a lone bonus token's copy is dropped by the
   write length;
2. the draft's children, level by level (its top ones; sampled, drawn without replacement from its processed rows):
   one pass per level of nodes with children, padded to a power of two; or, for `specexec`, a tree grown best first
   (a fixed number of passes over its most probable open nodes, the most probable nodes verified:
   methods/specexec/captured_growth.py), its parents device tensors like its tokens;
3. the target's pass over the tree (padded), after the committed tokens;
4. the verdict: greedy, a node is kept when its token is its parent's argmax and its parent is kept (the top-k
   children of a node are distinct, so at most one child of a kept node is); the deepest kept node ends the path
   and its argmax is the bonus token. Sampled, the `sequoia` verifier's walk (`verify/walk.py`) runs every level on
   the device; a grown tree is verified by target sampling instead (`specexec`'s verifier): a token drawn from each
   node's processed row stands for its argmax;
5. both caches keep the path's rows and move their write lengths; the next catch-up is the path's unforwarded leaf
   and the bonus token.

Greedy output is plain's: the verdict is the walk `verify/greedy.py` makes, and the first token is the prompt pass's
argmax, as plain computes it. Sampling is exact: the walk is the loop's. Either way the target's rows are processed
as plain processes them, every node's at once with its own ids in a fixed width (`logits/node_ids.py`: a repetition
penalty and the processors that read a row alone; the draft's rows take the latter only). A method sized every step
drafts one of a few bucketed shapes (`specexec`: of a few budgets, `GrowthSchedule`), chosen on the host before each
step from the verdicts already read (`ShapeSchedule`): one compiled function per shape met. The root alone (a sized
schedule's plain step, or a shape cut at the caches' end) is a plain step: the target's pass over the root and no
draft pass; the draft reads the tokens it missed in one eager pass before the next tree (`CapturedStep.resume`), as
the loop's drafters catch up after the guard's plain steps. The measured guard turns steps plain the same way while
speculation loses. What the step cannot take is refused before decoding (`captured_refusal`).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import Cache, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..accept.emit import BlockStops, emit
from ..accept.kv_cache import crop, is_static, keep_rows, set_length, static_capacity
from ..core.releases import cache_arg
from ..core.tree import HostTree, TokenTree
from ..draft.captured_tree import CATCH_UP, DraftedTree
from ..draft.draft_model import DraftModelRunner
from ..draft.shaped_tree import ModelTreeDrafter, planned_shape
from ..draft.sized_shape import SizedShapeDrafter
from ..logits.child_selection import select_children
from ..logits.node_ids import ROW_WISE, NodeIds, reads_ids, unsupported
from ..logits.wide_rows import row_argmax, row_topk
from ..methods.specexec.best_first import BestFirstDrafter
from ..methods.specexec.captured_growth import GrowthSchedule, GrowthSpec
from ..plan.guard import PlainGuard
from ..plan.shape_sizing import ShapeChooser, bucketed
from ..runtime.attention import AttentionLayout
from ..runtime.devices import execution_device
from ..runtime.model_info import embeddable, fit_vocabulary
from ..runtime.pass_shapes import PaddedTree, padded_size
from ..verify.random_source import TorchRandom
from ..verify.walk import ResidualWalk
from .loop import LoopResult, committed_on_error
from .outputs import TokenRecords
from .stats import SpeculationStats
from .step import prompt_pass

#: runs of a compiled step function (per call: a call's step owns new state tensors) the guard does not judge: with
#: mode="reduce-overhead" the first compiles (or warms up), the second records its CUDA graph; later ones replay
WARM_RUNS = 2


@dataclass(frozen=True)
class CapturedSampling:
    """How a sampled step draws: the call's processors (the target's rows take them all, each with its node's ids:
    `CapturedStep._processed`; the draft's only the row-wise ones, `scores`) and its generator (None: torch's global
    RNG, as plain sampling draws)."""

    processors: LogitsProcessorList
    generator: torch.Generator | None = None

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's rows processed by the row-wise processors: the distributions its children are drawn from. A
        penalty on the ids the draft's rows do not see lowers acceptance, never exactness: the verifier is given the
        distributions the children were drawn from."""
        row_wise = LogitsProcessorList([p for p in self.processors if isinstance(p, ROW_WISE)])
        return row_wise(logits.new_zeros((len(logits), 1), dtype=torch.long), logits)  # ids read by none

    def children(self, logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to `width` children per draft row drawn without replacement from its processed distribution (-1 where
        it has fewer tokens), and those distributions, which the verifier needs."""
        probs = self.scores(logits).softmax(-1)
        return select_children(probs, width, "without_replacement", self.generator), probs

    def draw(self, scores: torch.Tensor) -> torch.Tensor:
        """One token per processed target row `(rows,)`, drawn as plain sampling draws its next token."""
        return select_children(scores.softmax(-1), 1, "without_replacement", self.generator)[:, 0]


@dataclass(frozen=True)
class CapturedLevel:
    """One level of the shape whose nodes have children: the draft pass over them (None for the root's level, whose
    logits come with the catch-up) and where their top children go."""

    parents: torch.Tensor  # (k,) shape nodes
    rows: PaddedTree | None  # the draft pass's padded rows, after the node rows forwarded before
    size: int  # padded rows of that pass
    width: int  # the most children a parent has
    wanted: torch.Tensor  # (k, width) bool: parent i wants child j
    children: torch.Tensor  # shape nodes of the children, parent by parent
    child_rows: torch.Tensor
    child_cols: torch.Tensor


@dataclass(frozen=True)
class CapturedShape:
    """A tree shape's fixed buffers on the devices of the two models: everything a step needs besides the caches."""

    nodes: int
    size: int  # the target pass's padded rows
    depth: int  # the deepest node's depth
    parents: torch.Tensor  # (n,) on the target's device, the root's 0 (its own parent, kept by construction)
    depths: torch.Tensor  # (n,)
    ancestors: torch.Tensor  # (n, n) bool, a node its own ancestor
    target_rows: PaddedTree
    levels: tuple[CapturedLevel, ...]
    slots: torch.Tensor  # (n,) on the draft's device: each node's row among the forwarded ones (0 if never)
    forwarded: torch.Tensor  # (n,) bool: the draft forwarded the node (it has children)
    host: HostTree  # the parents on the host, for a sampled step's walk
    tree_parents: torch.Tensor  # (n,) on the target's device, the root's -1

    @classmethod
    def of(cls, shape: list[int], target_device: torch.device, draft_device: torch.device) -> CapturedShape:
        host, _, levels, slot_of = planned_shape(tuple(shape), torch.device(draft_device))
        depths, ancestors = host.structure()
        captured, earlier = [], torch.empty(0, dtype=torch.long)
        for index, level in enumerate(levels):
            k, width = len(level.parent_list), max(level.widths)
            wanted = torch.arange(width)[None] < torch.tensor(level.widths)[:, None]
            rows, size = None, 0
            if index > 0:
                size = padded_size(k)
                rows = PaddedTree.level(level.depths, level.sees, earlier, size, draft_device)
                earlier = torch.cat([earlier, level.depths])
            captured.append(CapturedLevel(level.parents, rows, size, width, wanted.to(draft_device), level.children,
                                          level.rows, level.cols))
        target_tree = planned_shape(tuple(shape), torch.device(target_device))[1]
        parents = torch.tensor([max(parent, 0) for parent in host.parents])
        return cls(len(shape), padded_size(len(shape)), max(host.depths()), parents.to(target_device),
                   depths.to(target_device), ancestors.to(target_device),
                   PaddedTree.of(target_tree, padded_size(len(shape)), target_device), tuple(captured),
                   torch.tensor([max(slot, 0) for slot in slot_of]).to(draft_device),
                   torch.tensor([slot >= 0 for slot in slot_of]).to(draft_device),
                   HostTree(parents=list(host.parents)), torch.tensor(host.parents).to(target_device))

    @property
    def draft_passes(self) -> int:
        """Draft passes a step runs: the catch-up, then one per level below the root's."""
        return 1 + sum(level.rows is not None for level in self.levels)

    @property
    def draft_pass_sizes(self) -> set[int]:
        return {level.size for level in self.levels if level.size}

    def draft(self, step: CapturedStep, logits: torch.Tensor, past: torch.Tensor, root: torch.Tensor) -> DraftedTree:
        """Each level's children, its top ones or drawn (a level's pass appends its nodes' rows after the earlier
        levels'), from the root's logits `(1, V)`; sampled, the distributions they were drawn from are kept for the
        verdict."""
        tokens = torch.full((self.nodes,), -1, dtype=torch.long, device=step.draft_device)
        tokens[:1] = root
        drawn_from = None if step.sampling is None else logits.new_zeros((self.nodes, logits.shape[-1]))
        for level in self.levels:
            if level.rows is not None:
                fed = tokens[level.parents].clamp(min=0)
                fed = torch.cat([fed, fed[:1].expand(level.size - len(fed))])
                positions, masks = level.rows.inputs(past, step.draft_width, step.draft_layout, step.draft.dtype,
                                                     origin=past - 1)
                logits = step._draft_pass(fed, positions, masks)[: len(level.parents)]
                for layer in step.draft_cache.layers:  # the padding rows are dropped
                    layer.cumulative_length.sub_(level.size - len(level.parents))
            if step.sampling is None:
                values, picked = row_topk(logits, level.width)
                kids = torch.where(level.wanted & (values > float("-inf")), picked, -1)
            else:
                picked, probs = step.sampling.children(logits, level.width)
                kids = torch.where(level.wanted, picked, -1)
                drawn_from = drawn_from.index_copy(0, level.parents, probs)
            tokens[level.children] = kids[level.child_rows, level.child_cols]
        return DraftedTree(tokens.to(step.target_device), self.parents, self.depths, self.ancestors, self.target_rows,
                           self.slots, self.forwarded, drawn_from)


class ShapeSchedule:
    """The shape of each captured step: a fixed shape's own; or, for a drafter sized every step (`SizedShapeDrafter`:
    `sequoia` and `chain` at their defaults, `tree` with `per_step`), one of a few shapes (`plan.shape_sizing.bucketed`:
    one per size bucket, the root alone included) chosen before each step by the drafter's cost model, which learns
    the sibling ranks kept from the verdicts read (nothing else is read for it). For `specexec` (`BestFirstDrafter`):
    its budget's tree grown on the device (`GrowthSpec`), or, sized every step, one of a few budgets
    (`GrowthSchedule`, which learns from the grown tree's parents and draft probabilities, read with the verdict)."""

    def __init__(self, drafter: ModelTreeDrafter | BestFirstDrafter) -> None:
        self.sized, self.grown = isinstance(drafter, SizedShapeDrafter), None
        if isinstance(drafter, BestFirstDrafter):  # `specexec`: a fixed budget, or a few sized every step
            grower = drafter.grower
            if drafter.sizer is None:
                self.fixed = GrowthSpec.of(grower.budget, grower.width, grower.beams, grower.max_depth)
            else:
                self.grown = GrowthSchedule(drafter.sizer, grower.width, grower.max_depth, grower.budget)
        else:
            self.fixed = tuple(drafter.host_shape.parents)
        if self.sized:
            self.sizer, self.ranks = drafter.sizer, drafter.ranks
            self.menu = bucketed(drafter.menu, drafter.sizer, drafter.ranks)
            self.chooser = ShapeChooser(self.menu, drafter.chooser.full_size)

    def next(self) -> tuple[int, ...] | GrowthSpec:
        if self.grown is not None:
            return self.grown.next()
        return tuple(self.menu.shapes[self.chooser.choose(self.sizer, self.ranks)]) if self.sized else self.fixed

    @property
    def shrunk_steps(self) -> int | None:
        """Steps drafted below the largest size (None: a fixed shape)."""
        return self.chooser.shrunk_steps if self.sized else self.grown.shrunk_steps if self.grown else None

    def learn(self, parents: tuple[int, ...] | GrowthSpec, tokens: list[int], path: list[int], learned: list[int]
              ) -> None:
        """A step over `parents` drafting `tokens` (-1: a node the draft could not fill, never a candidate) kept
        `path` (its nodes, root first); a grown tree's `learned` (`DraftedTree.learned`) also read."""
        if self.grown is not None and isinstance(parents, GrowthSpec):
            self.grown.learn(parents, learned, path)
        elif self.sized and len(parents) > 1:
            self.chooser.shrunk(len(parents))
            children = [[c for c in kids if tokens[c] >= 0] for kids in HostTree(parents=list(parents)).children()]
            self.ranks.learn(children, path, [children[parent].index(node) for parent, node in zip(path, path[1:])])


class CapturedStep:
    """Steps on the static caches of `target` and the draft `runner` (see the module's notes), of any shape.

    `first_row`: the root's logits as the prompt pass computed them (the call's first token, as plain takes it from
    them); `processors`: the call's, which the target's rows take (`_processed`; greedy too), `prompt` `(P,)` its ids.
    `start` loads the first catch-up; `step(shape)` runs a step and returns its read `(2 + depth + nodes,)`: the
    accepted count, the bonus token, the path's nodes below the root (the first `count` of them accepted), then every
    node's token (-1 where the draft could not fill it), then what the host learns from a grown tree
    (`DraftedTree.learned`).
    State between steps lives in device tensors updated in place, so a compiled step keeps its buffers; the shape is
    fixed per compiled function (`fitting` cuts it to whole levels where the caches' rows or the position table run
    out)."""

    def __init__(self, target: PreTrainedModel, cache: Cache, runner: DraftModelRunner, vocab: int | None,
                 first_row: torch.Tensor, sampling: CapturedSampling | None = None,
                 processors: LogitsProcessorList | None = None, prompt: torch.Tensor | None = None) -> None:
        self.target, self.cache, self.runner, self.vocab, self.sampling = target, cache, runner, vocab, sampling
        self.processors = processors or None
        self.draft, self.draft_cache = runner.model, runner.cache
        self.target_device, self.draft_device = execution_device(target), runner.device
        self.target_layout, self.draft_layout = AttentionLayout.of(target), runner.layout
        self.target_width, self.draft_width = static_capacity(cache), static_capacity(self.draft_cache)
        self.pending = torch.zeros(CATCH_UP, dtype=torch.long, device=self.draft_device)
        self.count = torch.ones((), dtype=torch.long, device=self.draft_device)
        self.first = torch.ones((), dtype=torch.bool, device=self.target_device)  # the first step: the root's row given
        self.first_row = first_row.to(self.target_device, torch.float32, copy=True)
        self.root = torch.zeros(1, dtype=torch.long, device=self.target_device)  # a plain step's input (`plain_step`)
        for state in (self.pending, self.count, self.first, self.first_row, self.root):  # mutated in place: CUDA
            torch._dynamo.mark_static_address(state)  # graphs keep their addresses, as Transformers' static caches
        self._shapes: dict[tuple[int, ...], CapturedShape] = {}
        # each node's ids, for the processors that read them (a repetition penalty): the committed sequence, kept here
        self.ids = (NodeIds(prompt.to(self.target_device), self.target_width + 1, len(self.first_row))
                    if reads_ids(processors) else None)

    def shape(self, key: tuple[int, ...] | GrowthSpec) -> CapturedShape | GrowthSpec:
        """A planned shape's buffers (made once a call), by its parents; a grown one is its own spec."""
        if isinstance(key, GrowthSpec):
            return key
        if key not in self._shapes:
            self._shapes[key] = CapturedShape.of(list(key), self.target_device, self.draft_device)
        return self._shapes[key]

    def start(self, pending: list[int]) -> None:
        """The draft has yet to read `pending` (1 or 2 committed tokens, the root last)."""
        padded = pending + pending[-1:] * (CATCH_UP - len(pending))
        self.pending.copy_(torch.tensor(padded))
        self.count.fill_(len(pending))

    def resume(self, plain_tokens: list[int]) -> None:
        """After plain steps, which ran no draft pass: the draft reads what it lacks (the tokens it had pending, then
        `plain_tokens`), all but the last in one eager pass; the last is the next step's root. One read (the pending
        count), once per return from plain steps."""
        count, *pending = torch.cat([self.count[None], self.pending]).tolist()
        lagging = pending[:count] + plain_tokens
        if len(lagging) > 1:
            ddev = self.draft_device
            before = self.draft_cache.layers[0].cumulative_length.clone()
            positions = before + torch.arange(len(lagging) - 1, device=ddev)
            columns = torch.arange(self.draft_width, device=ddev)
            masks = self.draft_layout.masks(columns[None] <= positions[:, None], positions, columns, self.draft.dtype,
                                            ddev)
            self._draft_pass(torch.tensor(lagging[:-1], device=ddev), positions, masks)
            set_length(self.draft_cache, before + len(lagging) - 1)
        self.start(lagging[-1:])

    def fitting(self, parents: tuple[int, ...] | GrowthSpec, committed: int) -> tuple[int, ...] | GrowthSpec:
        """`parents` cut to whole levels (a prefix: the shape is breadth first) that both caches and the target's
        position table hold after `committed` tokens; the root alone at least, else a ValueError. A grown shape
        loses levels, passes and nodes likewise (`GrowthSpec.within`)."""
        deepest = self.target_layout.deepest_node(committed - 1)
        if isinstance(parents, GrowthSpec):
            spec = parents.within(self.target_width - committed + 1, self.draft_width - committed - CATCH_UP, deepest)
            return self.fitting((-1,), committed) if spec is None else spec
        depths = HostTree(parents=list(parents)).depths()
        limit = max(depths) if deepest is None else min(deepest, max(depths))
        while limit >= 0:
            nodes = sum(depth <= limit for depth in depths)
            levels = sum(padded_size(sum(depth == d for depth in depths)) for d in range(1, limit))
            if (committed - 1 + padded_size(nodes) <= self.target_width
                    and committed + CATCH_UP + levels <= self.draft_width):
                return parents[:nodes]
            limit -= 1
        raise ValueError(f"The static cache is full: no row is left for the next token after {committed} tokens. "
                         "Pass a larger max_cache_len.")

    @torch.no_grad()
    def step(self, shape: CapturedShape | GrowthSpec) -> torch.Tensor:
        tdev, ddev = self.target_device, self.draft_device
        # 1. the draft reads the committed tokens it lacks; the root's logits are those of the last of them
        before = self.draft_cache.layers[0].cumulative_length.clone()
        positions = before + torch.arange(CATCH_UP, device=ddev)
        columns = torch.arange(self.draft_width, device=ddev)
        visible = columns[None] <= positions[:, None]
        masks = self.draft_layout.masks(visible, positions, columns, self.draft.dtype, ddev)
        logits = self._draft_pass(self.pending, positions, masks)
        past = before + self.count  # the draft's committed rows, the root's included
        set_length(self.draft_cache, past)
        root = self.pending.gather(0, (self.count - 1)[None])
        # 2. the draft's tree: its planned shape's levels, or grown best first (either way, passes after `past`)
        tree = shape.draft(self, logits.index_select(0, (self.count - 1)[None]), past, root)
        # 3. the target's pass over the tree, after the committed tokens but the root
        tokens = tree.tokens
        target_past = self.cache.layers[0].cumulative_length.clone()
        fed = torch.cat([tokens.clamp(min=0), tokens[:1].expand(shape.size - shape.nodes)])
        positions, masks = tree.target_rows.inputs(target_past, self.target_width, self.target_layout,
                                                   self.target.dtype)
        output = self.target(input_ids=fed[None], attention_mask=masks, position_ids=positions[None],
                             **cache_arg(self.cache), use_cache=True, return_dict=True)
        logits = output.logits[0, : shape.nodes].float()
        logits = torch.cat([torch.where(self.first, self.first_row, logits[0])[None], logits[1:]])
        scores = self._processed(logits, target_past, tokens, tree.ancestors)
        # 4. the verdict: the path's end and the bonus token; the path to it
        if self.sampling is not None and isinstance(shape, CapturedShape):
            leaf, bonus = self._walk(shape, tree, scores)
        else:  # greedy: each node's argmax; a grown tree sampled: a token drawn from each node's processed row
            picks = row_argmax(scores) if self.sampling is None else self.sampling.draw(scores)
            leaf, bonus = self._descend(shape.depth, tree, picks)
        accepted = tree.depths.index_select(0, leaf)
        levels = torch.arange(shape.depth + 1, device=tdev)
        on_path = tree.ancestors.index_select(0, leaf) & (tree.depths[None] == levels[:, None])
        path = on_path.int().argmax(-1)  # the path's node at each depth (the root past its end: never kept)
        # 5. the target keeps the path's rows (the root's and the accepted nodes'), the bonus token is the next root
        keep_rows(self.cache, target_past + path, target_past + levels)
        set_length(self.cache, target_past + accepted[0] + 1)
        if self.ids is not None:  # the path's tokens, then the bonus token after the accepted ones
            self.ids.write(target_past + 1 + levels[:-1], tokens.index_select(0, path[1:]).clamp(min=0))
            self.ids.write((target_past + 1 + accepted).reshape(1), bonus)
        # ... the draft keeps the accepted nodes it forwarded, and reads the rest (one leaf at most) and the bonus next
        drafted = path[1:].to(ddev)
        forwarded = (tree.forwarded[drafted] & (levels[1:].to(ddev) <= accepted.to(ddev))).sum()  # a prefix
        keep_rows(self.draft_cache, past + tree.slots[drafted], past + torch.arange(shape.depth, device=ddev))
        set_length(self.draft_cache, past + forwarded)
        leaf_token, bonus_draft = tokens.index_select(0, path.index_select(0, accepted)).to(ddev), bonus.to(ddev)
        unread = forwarded < accepted.to(ddev)[0]
        self.pending.copy_(torch.cat([torch.where(unread, leaf_token, bonus_draft), bonus_draft]))
        self.count.copy_(1 + unread.long())
        self.first.fill_(False)
        return torch.cat([accepted, bonus, path[1:], tokens, *([] if tree.learned is None else [tree.learned])])

    @torch.no_grad()
    def first_plain_step(self) -> torch.Tensor:
        """The call's first step, plain: its token from the prompt pass's row as plain takes it, and no pass at all (the
        prompt pass wrote the root's row; only the write length left it out). Eager, once a call; as `plain_step`."""
        return self._plain_token(self.first_row[None], self.cache.layers[0].cumulative_length.clone())

    @torch.no_grad()
    def plain_step(self, shape: CapturedShape) -> torch.Tensor:
        """A plain step after the first (`shape`: the root alone, `self.root`): the target's pass over the root and its
        token, as plain decoding takes it; no draft pass (the draft reads the plain steps' tokens in `resume`). Returns
        the token, (1,), which is also the next plain step's root."""
        target_past = self.cache.layers[0].cumulative_length.clone()
        fed = torch.cat([self.root, self.root.expand(shape.size - 1)])
        positions, masks = shape.target_rows.inputs(target_past, self.target_width, self.target_layout,
                                                    self.target.dtype)
        output = self.target(input_ids=fed[None], attention_mask=masks, position_ids=positions[None],
                             **cache_arg(self.cache), use_cache=True, return_dict=True)
        return self._plain_token(output.logits[0, :1].float(), target_past)

    def _plain_token(self, logits: torch.Tensor, target_past: torch.Tensor) -> torch.Tensor:
        """The root's token from its row `(1, V)` (argmax, or drawn from the processed row); the target keeps the
        root's row, and the token is the next root."""
        scores = self._processed(logits, target_past)
        token = row_argmax(scores) if self.sampling is None else self.sampling.draw(scores)
        set_length(self.cache, target_past + 1)
        if self.ids is not None:
            self.ids.write((target_past + 1).reshape(1), token)
        self.first.fill_(False)
        self.root.copy_(token)
        return token

    def _processed(self, logits: torch.Tensor, past: torch.Tensor, tokens: torch.Tensor | None = None,
                   ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """The target's rows (the root's at `past`, then the tree's `tokens` below it) processed as plain processes
        each node's next-token row; the raw rows where the call has no processors."""
        if self.processors is None:
            return logits
        ids = (self.ids.of(past, tokens, ancestors) if self.ids is not None
               else logits.new_zeros((len(logits), 1), dtype=torch.long))  # read by none
        return self.processors(ids, logits)

    @staticmethod
    def _descend(depth: int, tree: DraftedTree, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The deepest node kept (its token its parent's pick, its parent kept) and its pick, `(1,)` each; `picks`:
        the target's token at each node, `depth` bounds the tree's depth. A node's children carry distinct tokens,
        so at most one child of a kept node is kept: with argmax picks this is the greedy walk, with picks drawn
        from each node's row target sampling's (`TargetWalk`), every level's draw made up front."""
        kept = tree.tokens == picks[tree.parents]
        kept[0] = True
        for _ in range(depth):
            kept = kept & kept[tree.parents]
        leaf = torch.where(kept, tree.depths, -1).argmax()[None]  # indexed by tensors only: no host read
        return leaf, picks.index_select(0, leaf)

    def _walk(self, shape: CapturedShape, drafted: DraftedTree, scores: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `sequoia` verifier's walk over every level's processed rows, unread: where it ended and the token it
        emits there."""
        tree = TokenTree(tokens=drafted.tokens, parents=shape.tree_parents, draft_probs=drafted.drawn_from,
                         _host=shape.host)
        walk = ResidualWalk(tree, self.target_device, without_replacement=True)
        return walk.descend(scores, TorchRandom(self.sampling.generator))

    def _draft_pass(self, tokens: torch.Tensor, positions: torch.Tensor, masks) -> torch.Tensor:
        """The draft's float32 logits over the target's vocabulary, every fed row."""
        ids = embeddable(tokens, self.runner.input_rows)[None]
        output = self.draft(input_ids=ids, position_ids=self.draft_layout.model_positions(positions)[None],
                            attention_mask=masks, **cache_arg(self.draft_cache), use_cache=True, return_dict=True)
        return fit_vocabulary(output.logits[0].float(), self.vocab)


def captured_refusal(drafter: object, cache: Cache, processors: LogitsProcessorList, criteria: StoppingCriteriaList,
                     verifier: str, records: TokenRecords, token_inputs: bool, shared: bool,
                     batch: int = 1, compiled_generator: object = None) -> str | None:
    """Why this call's steps cannot be captured (a sentence naming the fix), or None. `verifier`: the call's ("greedy"
    unless it samples); `compiled_generator`: the call's `speculation_generator` where its steps are compiled."""
    if batch > 1:
        return f"it decodes a batch of {batch} sequences; captured steps decode one, or leave captured off"
    grown = isinstance(drafter, BestFirstDrafter)
    if not grown and type(drafter) not in (ModelTreeDrafter, SizedShapeDrafter):
        return ("the tree is sized by the draft's own probabilities; captured steps draft planned shapes (sequoia, "
                "tree, or chain with confidence_threshold=0) or best-first trees grown on the device (specexec)")
    if not grown and verifier not in ("greedy", "sequoia"):
        return (f"it samples with verifier={verifier!r}; captured steps draw children without replacement and verify "
                "as 'sequoia' does, so drop verifier (or pass 'sequoia') or leave captured off")
    if not is_static(cache):
        return "the cache is not static; pass cache_implementation='static' to generate"
    if verifier != "greedy" and compiled_generator is not None:
        return ("a speculation_generator is given, and a compiled step cannot draw from a torch.Generator (its graph "
                "would break at every draw); seed torch's global RNG (torch.manual_seed) instead, or leave captured "
                "off")
    others = unsupported(processors)
    if others:
        return (f"logits processors that read the ids' order or count are on ({', '.join(others)}); captured steps "
                "take repetition_penalty and the ones that read a row alone (temperature, top_k, top_p, min_p, "
                "typical_p, epsilon_cutoff, eta_cutoff, suppress_tokens, renormalize_logits), so unset the others "
                "(e.g. no_repeat_ngram_size, min_new_tokens, bad_words_ids) or leave captured off")
    if not BlockStops.of(criteria).on_host:
        return "a stopping criterion reads the device (stop strings, custom criteria); leave captured off for them"
    if records.wants_any:
        return "output scores, logits, hidden states or attentions are asked for; captured steps keep none"
    if token_inputs:
        return "the model takes per-token inputs (token types); leave captured off"
    if shared:
        return "the target is sharded over ranks; leave captured off"
    if drafter.runner.recurrent:
        return "the draft keeps a recurrent state; leave captured off"
    return None


@committed_on_error  # an exception (a criterion, a streamer, an interrupt) leaves the committed tokens only
def captured_loop(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    drafter: ModelTreeDrafter,
    cache: Cache,
    stopping_criteria: StoppingCriteriaList,
    vocab: int | None,
    streamer: BaseStreamer | None = None,
    stats: SpeculationStats | None = None,
    model_kwargs: dict | None = None,
    compile_step: Callable[[Callable], Callable] | None = None,
    sampling: CapturedSampling | None = None,
    guard: PlainGuard | None = None,
    processors: LogitsProcessorList | None = None,
) -> LoopResult:
    """Decode one sequence with captured steps of the drafter's shape (`captured_refusal` said yes), until a stopping
    criterion fires: greedily, or sampling as `sampling` says; the target's rows processed by `processors` (one
    sequence's: `logits.processing.row_processors`). `compile_step` wraps the step (`torch.compile`), or
    None to run it eagerly. `guard`: the measured guard (plan/guard.py), which turns steps plain while speculation
    loses; it judges each step timed whole (its read waits for the step's work), the draft's prompt pass apart."""
    stats = stats or SpeculationStats()
    stats.captured = True
    start = time.perf_counter()
    prefill = prompt_pass(target, input_ids, cache, model_kwargs or {}, False)
    runner = drafter.runner
    ids = drafter.sequence.read(input_ids)
    if len(ids) > 1:  # the draft reads the prompt but its last token in an eager pass, the root in the first step
        synced = time.perf_counter()
        runner.sync(ids[:-1])
        if guard is not None:  # what a call's draft prompt pass costs: the call price's (`PlainGuard.price`)
            guard.observe_prompt(time.perf_counter() - synced, len(ids) - 1)
    step = CapturedStep(target, cache, runner, vocab, prefill.logits[0, -1], sampling, processors, input_ids[0])
    step.start(ids[-1:])
    schedule, runs, ran = ShapeSchedule(drafter), {}, Counter()
    stats.time_prefill = time.perf_counter() - start
    stops = BlockStops.of(stopping_criteria)
    finished, first, last, behind = False, True, ids[-1], None  # behind: the plain steps' tokens the draft lacks
    while not finished:
        # one function per shape: the schedule's, cut to whole levels near the caches' or the position table's end;
        # the root alone is a plain step, which leaves the draft behind until the next tree
        guarded = guard is not None and guard.plain_next()
        parents = (-1,) if guarded else step.fitting(schedule.next(), input_ids.shape[1])
        shape = step.shape(parents)
        plain = shape.nodes == 1
        if parents not in runs:
            runs[parents] = functools.partial(step.plain_step if plain else step.step, shape)
            runs[parents] = runs[parents] if compile_step is None else compile_step(runs[parents])
        t0 = time.perf_counter()
        passless = plain and first  # the prompt pass gave the first step's token: no pass (`first_plain_step`)
        if plain:
            if behind is None:
                step.root.fill_(last)
                behind = []
            block = (step.first_plain_step() if passless else runs[parents]()).tolist()  # the step's one read
            behind += block
        else:
            if behind is not None:
                step.resume(behind)
                stats.draft_forwards += 1  # the eager catch-up pass
                behind = None
            read = runs[parents]().tolist()  # the step's one read
            accepted, bonus, nodes = read[0], read[1], read[2: 2 + shape.depth]
            tokens, learned = read[2 + shape.depth: 2 + shape.depth + shape.nodes], read[2 + shape.depth + shape.nodes:]
            block = [tokens[node] for node in nodes[:accepted]] + [bonus]
            schedule.learn(parents, tokens, [0, *nodes[:accepted]], learned)
            stats.draft_forwards += shape.draft_passes
            stats.draft_pass_sizes.update({CATCH_UP} | shape.draft_pass_sizes)
        last = block[-1]
        t1 = time.perf_counter()
        input_ids, emitted, finished = emit(input_ids, block, torch.empty(len(block), 0), stopping_criteria, stops)
        ran[parents] += not passless
        if guard is not None and not passless and (compile_step is None or ran[parents] > WARM_RUNS):
            guard.observe(t1 - t0, emitted, plain)  # not a compiling run's time, nor a step that ran no pass
        if streamer is not None:
            streamer.put(torch.tensor(block[:emitted]))
        stats.target_forwards += not passless
        first = False
        stats.drafted_tokens += shape.nodes - 1
        stats.new_tokens += emitted
        stats.tokens_per_step.append(emitted)
        stats.plain_steps += plain
        stats.tree_pass_sizes.add(shape.size)
        stats.time_verifying += t1 - t0
    if emitted < len(block):  # a stop inside the block: the cache holds the sequence but its last token, as plain's
        crop(cache, input_ids.shape[1] - 1)
    stats.graphs_compiled = len(runs) if compile_step is not None else 0
    if schedule.shrunk_steps is not None:  # (no size probes: no pass is timed apart, so every shape is priced by
        stats.shrunk_steps = schedule.shrunk_steps  # the curves)
    stats.time_total = time.perf_counter() - start
    if streamer is not None:
        streamer.end()
    return LoopResult(sequences=input_ids, records=TokenRecords(), stats=stats)
