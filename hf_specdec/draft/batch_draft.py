"""A draft model over a batch's rows in lockstep: one cache, ragged like the target's; passes over every row at once.

What the lockstep drafters share (`batch_shaped.LockstepShapeDrafter`: one fixed shape for every row;
`methods.specexec.lockstep`: each row's own best-first tree). Each step first feeds every row the tokens its draft
cache lacks (the last step's emitted tokens, the root last) as one pass of per-row chains, which commits them and gives
each root's logits (`catch_up`); node passes then append the same number of columns to every row (`node_pass`: each
node sees its row's committed columns and the node columns it is told to). After the verdicts each row keeps the
columns of the accepted nodes the draft forwarded (`kept_slots`), so the next catch-up feeds a row only what the draft
has not seen.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, PreTrainedModel

from ..accept.ragged import RaggedRows
from ..core.model_inputs import explicit_parameters
from ..core.releases import cache_arg
from ..core.tree import TokenTree, additive_mask
from ..plan.guard import PlainGuard
from ..runtime.attention import AttentionLayout
from ..runtime.devices import PassClock, execution_device
from ..runtime.model_info import embeddable, fit_vocabulary


class LockstepDraft:
    """`draft_model` over `rows` rows: its ragged cache, the rows' committed tokens and the passes over all of them."""

    guard: PlainGuard | None = None  # the measured guard of the batch's whole steps, where one watches them

    def __init__(self, draft_model: PreTrainedModel, rows: int, vocab: int | None = None) -> None:
        self.model, self.vocab = draft_model, vocab
        self.device = execution_device(draft_model)
        self.layout = AttentionLayout.of(draft_model)
        self.input_rows = getattr(draft_model.get_input_embeddings(), "num_embeddings", None)
        self.keeps_logits = "logits_to_keep" in explicit_parameters(draft_model)  # else the columns are sliced here
        self.cache = DynamicCache()
        self.rows = RaggedRows(torch.zeros(rows, 0, dtype=torch.bool, device=self.device))
        self.committed = [0] * rows  # per batch row: how many of its tokens the draft cache holds
        self.origin = list(range(rows))  # per batch row: its row in the call's batch (rows that finish leave)
        self.node_slots = 0  # cache columns the last step's node passes appended after the committed ones
        self.kept_slots: list[list[int]] = [[] for _ in range(rows)]  # per batch row: of those, its accepted ones
        self.clock = PassClock(self.device)
        self.forward_count = 0
        self.prefill_seconds = 0.0  # of the draft passes, the first: it reads every row's prompt (the call's setup)
        self._started: float | None = None  # when the last step began (a step runs until the next proposal)
        # the last step's (plain, tokens of every row, rows, draft seconds and draft prefill seconds when it began)
        self._step = (False, 0, 0, 0.0, 0.0)

    def guard_says_plain(self, rows: int) -> bool:
        """A step over `rows` rows begins: the guard, where one watches, is handed the last step whole (every row's
        drafting and tokens, the draft's prefill left out: the call's setup) and says whether this one is plain."""
        now = time.perf_counter()
        plain, tokens, last_rows, draft_before, prefill_before = self._step
        if self.guard is not None and self._started is not None and tokens:
            setup = self.prefill_seconds - prefill_before  # the draft's prefill (first step): not a step's cost
            self.guard.observe(now - self._started - setup, tokens, plain, self.forward_time - draft_before - setup,
                               rows=last_rows)
        self._started = now
        return self.guard is not None and self.guard.plain_next(rows)

    def step_kind(self, plain: bool, rows: int) -> None:
        """The step begun is a plain one (every row's root alone) or not, over `rows` rows."""
        self._step = (plain, 0, rows, self.forward_time, self.prefill_seconds)

    def step_emitted(self, emitted: list[int]) -> None:
        """The step's rows emitted `emitted` tokens: what the guard judges it by at the next step."""
        plain, _, rows, *before = self._step
        self._step = (plain, sum(emitted), rows, *before)

    @property
    def forward_time(self) -> float:
        return self.clock.total

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 columns: list[int] | None = None) -> torch.Tensor:
        """float32 logits `(B, n, vocab)` of one pass over `tokens` `(B, n)`, appended to the cache; with `columns`,
        only those columns' `(B, len(columns), vocab)`: the output layer then runs over them alone (the root pass
        needs one column per row, and the first one feeds whole prompts, where the output layer over every prompt
        token would cost a third of the pass)."""
        self.clock.start()
        kept = {}
        if columns is not None and self.keeps_logits:
            kept = {"logits_to_keep": torch.tensor(columns, dtype=torch.long, device=self.device)}
        with torch.no_grad():
            out = self.model(input_ids=embeddable(tokens, self.input_rows),
                             position_ids=self.layout.model_positions(positions), attention_mask=mask,
                             **cache_arg(self.cache), use_cache=True, **kept)
        logits = out.logits if columns is None or kept else out.logits[:, columns]
        logits = fit_vocabulary(logits.float(), self.vocab)
        self.clock.stop()
        self.forward_count += 1
        return logits

    def catch_up(self, ids: list[list[int]]) -> torch.Tensor:
        """Keep each row's accepted node columns of the last step, drop the others, then feed every row the tokens
        of `ids[r]` (its sequence, the root last) its cache lacks, in one pass: the roots' logits `(B, vocab)`."""
        batch, device = len(ids), self.device
        self.keep_accepted(batch)
        fresh = [row[done:] for row, done in zip(ids, self.committed)]
        chains = [TokenTree.from_parents(tokens, list(range(-1, len(tokens) - 1))) for tokens in fresh]
        tokens_in, positions, mask = self.rows.tree_inputs(chains, self.model.dtype)
        ends = [len(row_tokens) - 1 for row_tokens in fresh]  # each row's root: the last token it feeds
        columns = sorted(set(ends))
        prefill, before = not any(self.committed), self.clock.total
        logits = self._forward(tokens_in, positions, mask, columns)
        if prefill:  # a one-off cost of the call, which no step's cost model or guard should be charged with
            self.prefill_seconds += self.clock.total - before
        root_logits = logits[torch.arange(batch, device=device),
                             torch.tensor([columns.index(end) for end in ends], device=device)]
        self.rows.keep(self.cache, [list(range(len(f))) for f in fresh])
        self.committed = [len(row) for row in ids]
        return root_logits

    def keep_accepted(self, batch: int) -> None:
        """Each of the `batch` rows keeps the node columns of the last step it accepted (`kept_slots`); the others
        go. Done at the start of every step, whether it drafts or not."""
        if self.node_slots:
            self.rows.keep(self.cache, self.kept_slots)
            self.committed = [done + len(slots) for done, slots in zip(self.committed, self.kept_slots)]
        self.node_slots, self.kept_slots = 0, [[] for _ in range(batch)]

    def root_positions(self) -> torch.Tensor:
        """`(B, 1)`: each row's root position (its committed tokens, after `catch_up`, less one)."""
        return self.rows.valid.sum(dim=1, keepdim=True) - 1

    def node_pass(self, tokens: torch.Tensor, depths: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
        """One pass over `n` nodes per row, appended after the committed columns and the `old` node columns this step
        forwarded so far: `tokens` and `depths` `(B, n)` (depth 1: a child of the root), `sees` `(B, n, old + n)`
        bool, which earlier node columns and which of this pass's nodes each sees (itself included). The nodes'
        logits `(B, n, vocab)`."""
        batch, n = tokens.shape
        committed = self.rows.length
        allowed = torch.cat([self.rows.valid[:, None, :].expand(batch, n, committed), sees.to(self.device)], dim=2)
        logits = self._forward(tokens, self.root_positions() + depths.to(self.device),
                               additive_mask(allowed, self.model.dtype)[0, 0][:, None])
        self.node_slots += n
        return logits

    def drop(self, keep: list[int]) -> None:
        """Keep only batch rows `keep` (rows that finished leave)."""
        self.rows.select(self.cache, keep)
        self.committed = [self.committed[index] for index in keep]
        self.origin = [self.origin[index] for index in keep]
        self.kept_slots = [self.kept_slots[index] for index in keep]

    def counts(self, row: int) -> tuple[int, float]:
        """Draft passes and their seconds, shared by every row."""
        return self.forward_count, self.forward_time
