"""Draft one fixed shape for every row of a batch in lockstep: one draft pass per level for all rows together.

The batch form of `ModelTreeDrafter` (whose shape levels it reuses), on the lockstep draft (`batch_draft.py`: a
cache ragged like the target's). Each step first feeds every row the tokens its draft cache lacks, which gives each
root's logits; then each level's nodes of every row go through one pass, seeing the row's committed columns and the
level's forwarded ancestors (the same slots in every row: the shape is shared, the tokens are each row's). After
the verdicts each row keeps the slots of the accepted nodes the draft forwarded (ragged, as the target keeps its
accepted nodes), so the next step's first pass feeds a row only what the draft has not seen: the bonus token and the
accepted leaf, not the whole accepted block again.

With `threshold` (a chain's `confidence_threshold`), Transformers' confidence stop is taken for the batch as a
whole (`batch_goes_on`): a row's chain is still going where its own single-sequence stop would not have stopped it
(every drafted token at least `threshold` likely), and the next level is drafted while the rows' chains, averaged
over the batch, are at least `threshold` likely to go on. That is the single sequence's rule for one row and, for
B rows, its price: the next level adds B tokens to the padded target pass, worth it where on average a row's token
is as likely to be used as one sequence's must be (drafting on while any row is sure would keep 8 rows' chains
long for one row's sake). One read per level, which carries the drafted tokens, so a step that stops needs no second
read. Rows already stopped draft on with the others; their deeper tokens are proposed as usual
(the padded pass holds them anyway). Exact as the single sequence's stop is: it reads drafted tokens only, never a
verdict.
"""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from ..core.tree import HostTree, TokenTree
from ..logits.child_selection import select_children
from ..logits.processing import process_tree_scores
from ..plan.guard import PlainGuard
from .batch_draft import LockstepDraft
from .draft_model import forwarded_prefix
from .shaped_tree import ModelTreeDrafter, read_with_tokens


class LockstepShapeDrafter(LockstepDraft):
    """`shape` (a parents list, BFS order) drafted for every row of a batch, one draft pass per level."""

    guard: PlainGuard | None = None  # the measured guard of the batch's whole steps (`batch_sized`: when sized)

    def __init__(
        self,
        draft_model: PreTrainedModel,
        shape: list[int],
        rows: int,
        logits_processor: LogitsProcessorList | list[LogitsProcessorList | None] | None = None,
        child_selection: str = "top_k",
        generator: torch.Generator | None = None,
        vocab: int | None = None,
        threshold: float | None = None,
    ) -> None:
        super().__init__(draft_model, rows, vocab)
        self.plan = ModelTreeDrafter(draft_model, shape, None, child_selection, generator, vocab)  # shape + levels
        # one list per row (`core.processing.row_processors`: a row's padding, its batch id), or one for all
        shared = logits_processor is None or isinstance(logits_processor, LogitsProcessorList)
        self.processors = [logits_processor] * rows if shared else list(logits_processor)
        self.child_selection, self.generator = child_selection, generator
        self._nodes: list[list[int] | None] = [None] * rows  # per batch row: the shape node of each tree node
        self.log_threshold = math.log(threshold) if threshold else None  # None: every level, every step
        self.levels_run = 0  # levels drafted in the last step: nodes deeper than that were never forwarded
        self.forwarded_slots: list[int] = []  # per shape node, its draft-cache slot in the last step (-1: none)

    def use_shape(self, shape: list[int]) -> None:
        """Draft `shape` for every row from the next step on (a batch sized every step switches between shapes)."""
        self.plan.use_shape(shape)

    def propose(self, ids: list[list[int]], prefixes: list[torch.Tensor], unpadded=None) -> list[TokenTree]:
        """The trees of every row: `ids[r]` the row's tokens (its root last), `prefixes[r]` `(1, L)` what the call's
        processors see before row r's root."""
        plan, batch, device = self.plan, len(ids), self.device
        shape, n = plan.shape, len(plan.shape)
        self._nodes = [None] * batch
        if n == 1:  # a root-only plan: no draft pass at all (the target decodes plainly); it catches up next step
            self.keep_accepted(batch)
            return [TokenTree.from_parents([row[-1]], [-1]) for row in ids]
        root_logits = self.catch_up(ids)
        roots = torch.tensor([row[-1] for row in ids], dtype=torch.long, device=device)
        tokens = roots[:, None].repeat(1, n)
        tokens[:, 1:] = -1
        sampling = self.child_selection != "top_k"
        draft_probs = torch.zeros(batch, n, root_logits.shape[-1], device=device) if sampling else None
        going = torch.ones(batch, dtype=torch.bool, device=device)  # rows whose own stop has not stopped them
        for index, level in enumerate(plan.levels):
            self.levels_run = index + 1
            if level.parent_list[0] == 0:
                level_logits = root_logits[:, None]
            else:
                p = len(level.parent_list)
                sees = level.sees.to(device, copy=True)  # the level is shared by every call: never written
                sees[:, self.node_slots :] |= torch.eye(p, dtype=torch.bool, device=device)
                before = self.clock.total
                level_depths = level.depths[None].expand(batch, -1)
                level_logits = self.node_pass(tokens[:, level.parents].clamp(min=0), level_depths,
                                              sees[None].expand(batch, -1, -1))
                self._level_timed(p, self.clock.total - before)
            scores = self._scores(tokens, level.parent_list, level_logits, prefixes)
            probs = scores.softmax(-1) if sampling else scores
            if sampling:
                draft_probs[:, level.parents] = probs
            width = probs.shape[-1]
            kids = select_children(probs.reshape(-1, width), level.widths * batch, self.child_selection,
                                   self.generator).view(batch, len(level.parent_list), -1)
            kids = torch.where(tokens[:, level.parents, None] >= 0, kids, -1)
            tokens[:, level.children] = kids[:, level.rows, level.cols]
            if self.log_threshold is not None and index + 1 < len(plan.levels):
                logq = scores.float().log_softmax(-1).gather(-1, kids.clamp(min=0))
                likeliest = torch.where(kids >= 0, logq, -math.inf).flatten(1).amax(1)  # per row, of this level
                going, on = batch_goes_on(going, likeliest, self.log_threshold)
                sure, flat = read_with_tokens(on, tokens)
                if not sure:  # the rows' chains not likely enough to go on: deeper levels stay undrafted (-1), pruned
                    token_lists = [flat[row * n : (row + 1) * n] for row in range(batch)]
                    break
        else:
            token_lists = tokens.tolist()  # the step's one read of the drafted tokens
        depths = plan.host_shape.depths()  # a node of a level not run was drafted, never forwarded: no slot
        self.forwarded_slots = [slot if depth < self.levels_run else -1 for slot, depth in zip(plan.slot_of, depths)]
        trees = []
        for row, token_list in enumerate(token_lists):
            tree = TokenTree(tokens=tokens[row], parents=shape.parents, _depths=shape.depths,
                             _ancestors=shape.ancestors, _host=HostTree(plan.host_shape.parents, token_list),
                             draft_probs=draft_probs[row] if sampling else None)
            keep = [node for node, token in enumerate(token_list) if token >= 0]
            trees.append(tree if len(keep) == n else tree.select(keep))
            self._nodes[row] = None if len(keep) == n else keep
        return trees

    def _scores(self, tokens: torch.Tensor, parents: list[int], logits: torch.Tensor,
                prefixes: list[torch.Tensor]) -> torch.Tensor:
        """The draft's processed scores `(B, parents, vocab)` at this level's parents, each row with its prefix."""
        if not any(self.processors):
            return logits
        shape = self.plan.shape
        rows = []
        for row, prefix in enumerate(prefixes):
            so_far = TokenTree(tokens=tokens[row].clamp(min=0), parents=shape.parents, _depths=shape.depths,
                               _ancestors=shape.ancestors, _host=self.plan.host_shape)
            rows.append(process_tree_scores(self.processors[row], prefix, so_far, logits[row], parents,
                                            any_tie_order=True))
        return torch.stack(rows)

    def _level_timed(self, nodes: int, seconds: float) -> None:
        """A level's pass over `nodes` nodes per row (not the root's, which also feeds the emitted tokens) took
        `seconds`: what a batch sized every step corrects its draft curve with."""

    def accept(self, index: int, input_ids: torch.Tensor, tree: TokenTree, verdict) -> None:
        """Batch row `index` keeps the slots of the accepted nodes the draft forwarded (a prefix of the accepted
        path); the next step feeds it the rest of what it emitted."""
        nodes = self._nodes[index]
        path = [node if nodes is None else nodes[node] for node in verdict.path[1:]]
        self.kept_slots[index] = forwarded_prefix([self.forwarded_slots[node] for node in path])

    def observe_step(self, sizes: list[int], seconds: float, emitted: list[int]) -> None:
        """The step's target pass over trees of `sizes` nodes took `seconds`; the rows emitted `emitted` tokens. A
        fixed shape is not sized by them."""

    def drop(self, keep: list[int]) -> None:
        super().drop(keep)
        self.processors = [self.processors[index] for index in keep]
        self._nodes = [self._nodes[index] for index in keep]

    def shrunk_steps(self, row: int) -> int:
        """Steps whose tree for the call's row `row` was cut below the full shape (a fixed shape: none)."""
        return 0

    def size_probes(self, row: int) -> int:
        """Steps whose tree for the call's row `row` was larger than any pass the sizing had timed (fixed: none)."""
        return 0


def batch_goes_on(going: torch.Tensor, likeliest: torch.Tensor, log_threshold: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The confidence stop of a batch's chains after one level. `going` `(B,)`: the rows whose own stop has not
    stopped them yet; `likeliest` `(B,)`: each row's log draft probability of its likeliest token this level (-inf:
    none). Returns the rows still going and whether to draft the next level: while the mean over the batch of a
    still-going row's probability is at least the threshold (log space, so one row is exactly the single rule)."""
    going = going & (likeliest >= log_threshold)
    mean = torch.logsumexp(torch.where(going, likeliest, -math.inf), dim=0) - math.log(len(likeliest))
    return going, mean >= log_threshold
