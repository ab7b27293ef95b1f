"""The speculative loop over a left-padded batch: every row drafts its own tree and accepts its own path each step
(ragged acceptance), and one target pass verifies all rows' trees. Its steps are the single sequence's (`loop.py`),
from the same parts (`step.py`: the prompt's pass, the tree fitted to its positions, `judge`'s verdicts and emitted
tokens); what differs is where the rows sit in the cache.

Each row has its own drafter (any method's: its draft cache, plan and state are per sequence, and it sees the row
without its padding), and the rows' trees go through the target together, padded to the largest tree
(`accept.ragged.RaggedRows`: per-row valid cache columns, positions and masks). Every row is verified by the call's
verifier on its own scores (logits processors applied to the padded row, as plain batched `generate` applies
them, each row with its own processors: `logits.processing.row_processors`) and stopped by the call's stopping
criteria on its own sequence; a row that stops leaves the batch (its cache rows are dropped, so it costs no more
target rows; `batch_cache.FinishedRows` keeps them when the cache is returned) and its output is padded with
`pad_token_id`, as plain batched `generate` writes after a finished row. A greedy step reads
what a single sequence's step reads, whatever the batch size: the rows' verdicts are decided together
(`verify_rows`) and their stopping checks read in one transfer (`accept.emit.emit_rows`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from ..accept.emit import BlockStops
from ..accept.ragged import RaggedRows
from ..core.releases import cache_arg
from ..core.verdict import Verifier
from ..draft.batch_draft import LockstepDraft
from ..draft.row_drafters import RowDrafters
from ..logits.processing import row_processors
from ..runtime.attention import AttentionLayout
from ..runtime.device_copies import DeviceCopies
from ..runtime.devices import PassClock, compute_devices, execution_device
from ..runtime.ranks import Ranks
from .batch_cache import FinishedRows
from .stats import SpeculationStats
from .step import fit_positions, judge, lean_target, prompt_pass, record_step, renumbered


@dataclass
class BatchResult:
    sequences: torch.LongTensor  # (B, prompt + longest row's new tokens), finished rows padded with pad_token_id
    stats: list[SpeculationStats]  # one per row
    cache: DynamicCache | None = None  # with returns_cache: every row in plain generate's layout (`batch_cache`)


def batch_speculative_loop(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    drafter: RowDrafters | LockstepDraft,
    verifier: Verifier,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    stats: list[SpeculationStats] | None = None,
    model_kwargs: dict | None = None,
    cache: DynamicCache | None = None,
    returns_cache: bool = False,
    lean: bool | None = None,
) -> BatchResult:
    """Decode every row of `input_ids` `(B, P)` (left-padded: `attention_mask` 0 on pads) until its stopping
    criteria fire; `drafter` drafts every row's tree. `cache`: an empty `DynamicCache` of full-length layers
    (default a new one). With `returns_cache`, each row's columns are kept as it leaves the batch and the cache
    ends in plain batched generate's layout for the returned sequences (`decoding.batch_cache`); otherwise it ends
    empty (every row has left). `lean`: the config's `lean_target` setting (None: off the CPU only)."""
    batch, prompt = input_ids.shape
    stats = stats or [SpeculationStats() for _ in range(batch)]
    host = [row[pad:] for row, pad in zip(input_ids.tolist(), (attention_mask == 0).sum(dim=1).tolist())]
    device, dtype = execution_device(target), target.dtype
    layout = AttentionLayout.of(target)
    forward = lean_target(target, layout, copies=DeviceCopies.of(target), ranks=Ranks.of(target), use=lean) or target
    stops = BlockStops.of(stopping_criteria)
    clock = PassClock(compute_devices(target))
    start = time.perf_counter()
    cache = DynamicCache() if cache is None else cache
    kwargs = {**(model_kwargs or {}), "attention_mask": attention_mask, **cache_arg(cache)}
    prefill = prompt_pass(target, input_ids, cache, kwargs, False)
    first_logits = prefill.logits[:, -1]
    prefill_seconds = time.perf_counter() - start
    rows = RaggedRows(attention_mask[:, :-1].to(device))
    pads = (attention_mask == 0).sum(dim=1).tolist()  # the host's one look at the padding
    sequences = [input_ids[row : row + 1] for row in range(batch)]  # padded: what processors and criteria see
    unpadded = [sequences[row][:, pads[row] :] for row in range(batch)]  # what a drafter continues
    active = list(range(batch))  # the original row of each batch row still decoding
    finished_rows = FinishedRows(prompt - 1) if returns_cache else None
    processors = [row_processors(logits_processor, row, batch) for row in range(batch)]  # each row's own state
    first_step = True
    while active:
        # 1. every row still decoding gets a tree, cut to the positions its row may use
        t0 = time.perf_counter()
        drafted = drafter.propose([host[row] for row in active], [sequences[row][:, :-1] for row in active],
                                  [unpadded[row] for row in active])
        fitted = [fit_positions(tree, layout, unpadded[row].shape[1] - 1, target)
                  for tree, row in zip(drafted, active)]
        trees = [tree for tree, _ in fitted]
        t1 = time.perf_counter()
        # 2. one target pass over every row's tree
        tokens, positions, mask = rows.tree_inputs(trees, dtype)
        timed = clock.total
        clock.start()
        output = forward(input_ids=tokens, attention_mask=mask, position_ids=positions, **cache_arg(cache),
                         use_cache=True, return_dict=True)
        clock.stop()
        # 3. each row's nodes processed with that row's own processors, every row's verdict, and
        # 4. each row's accepted path and bonus token emitted, stopping where its criteria fire
        judged = judge(verifier, trees, [output.logits[index, : len(tree)] for index, tree in enumerate(trees)],
                       [sequences[row] for row in active], [processors[row] for row in active], stopping_criteria,
                       stops, device, generator, first=[first_logits[row : row + 1] for row in active]
                       if first_step else None)
        seconds = clock.total - timed  # asked after the verdicts' read: on a GPU, asking waits for the pass
        kept, still = [], []
        for index, (row, tree, (_, cut), step) in enumerate(zip(active, trees, fitted, judged)):
            verdict, emitted = step.verdict, step.emitted
            sequences[row], unpadded[row] = step.sequence, step.sequence[:, pads[row] :]
            host[row] += step.block[:emitted]
            kept.append(verdict.path[:emitted])
            if not step.finished:
                still.append(index)
                drafter.accept(index, unpadded[row], drafted[index], verdict if cut is None else renumbered(verdict,
                                                                                                             cut))
            record_step(stats[row], tree, verdict, emitted)
            stats[row].time_target_forward += seconds / len(active)
            stats[row].time_drafting += (t1 - t0) / len(active)
        # 5. the drafter learns the step; the cache keeps each row's path; finished rows leave the batch
        drafter.observe_step([len(tree) for tree in trees], seconds, [len(path) for path in kept])
        rows.keep(cache, kept)
        if len(still) < len(active):
            if finished_rows is not None:  # their columns, before they leave the cache
                leaving = [index for index in range(len(active)) if index not in still]
                finished_rows.take(cache, rows, leaving, [active[index] for index in leaving])
            rows.select(cache, still)
            drafter.drop(still)
            active = [active[index] for index in still]
        first_step = False
    returned = None if finished_rows is None else finished_rows.into(
        cache, target, [sequence.shape[1] for sequence in sequences], pads, [tokens[-1] for tokens in host],
        pad_token_id)
    total = time.perf_counter() - start
    for row, row_stats in enumerate(stats):
        row_stats.time_prefill, row_stats.time_total = prefill_seconds, total
        row_stats.draft_forwards, row_stats.time_draft_forward = drafter.counts(row)
        row_stats.shrunk_steps, row_stats.size_probes = drafter.shrunk_steps(row), drafter.size_probes(row)
    return BatchResult(sequences=padded(sequences, pad_token_id), stats=stats, cache=returned)


def padded(sequences: list[torch.LongTensor], pad_token_id: int) -> torch.LongTensor:
    """The rows `(1, L_r)` as one `(B, max L_r)` tensor, each shorter row continued with `pad_token_id`."""
    width = max(sequence.shape[1] for sequence in sequences)
    out = sequences[0].new_full((len(sequences), width), pad_token_id)
    for row, sequence in enumerate(sequences):
        out[row, : sequence.shape[1]] = sequence[0]
    return out
