"""A draft model and its KV cache across steps: the one place drafters run a model.

Cache layout: the committed tokens (a prefix of the sequence, its last token the next tree's root), then the
tree nodes forwarded while proposing the current tree, one slot each. `forward_tree` appends nodes with tree
attention (each sees the committed tokens, the earlier slots and in-pass nodes it is told to see, and itself) and,
given the new context, first brings the committed part up to date in the same pass; `sync` is that catch-up alone
(it returns the root's logits); `commit` keeps the slots of the accepted path and drops every other node. No model
ever re-reads a token it has already seen.

With a window (`use_window`), the draft reads only the prompt's last `window` tokens: from the call's first pass on,
the ids it is given lose the prompt's first `len(prompt) - window` (`dropped`), its positions count from the
window's start (rotary models attend by relative position), and token types are looked up at their place in the
sequence. Why: a draft's pass over a long prompt costs about what its size says against the target's (a third, for
the 0.5B draft of a 1.5B target), and every later draft pass attends to all of it; the draft only proposes, so what it
does not read changes no output, only how often it is right (`benchmarks/results/zen5/draft-window`).

The cache keeps every row (no sliding-window layers: compaction moves rows) and remembers each node slot's position,
so sliding-window layers get their window by position in the masks (`core.attention`).

A draft with recurrent state (Mamba, linear attention) drafts chains only: one node a pass, each seeing everything
before it, so every pass is a plain causal one (no tree mask), and its cache (the model's own layers) rolls back to
the accepted prefix with Transformers' rollback (`accept.kv_cache`). A pass over several tokens after others keeps
the state after each of them (`record_states`), as the model's single-token passes compute it.

When the target decodes on a static cache, so does the draft (`use_static_cache`): a `StaticCache` kept on the draft
model from call to call (as Transformers keeps the target's), compacted in place, and every pass that feeds tree
nodes padded to a power-of-two row count with masks as wide as the cache (`runtime.pass_shapes`), so a compiled draft
forward reuses a few graphs. The padding rows are written past the pass's own rows and the write length is reset
over them at once. A pass over a level of nodes builds its positions and masks on the device from the level, kept
for the call (`PassShapes.padded_level`): no host-built mask crosses per level. A catch-up over many tokens (the
prompt, a run of plain steps) runs eagerly and unpadded, as a prefill does.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from ..accept.kv_cache import (
    cache_length,
    full_length_cache,
    keep_positions,
    record_states,
    static_capacity,
    static_copy,
)
from ..core.model_inputs import TokenInputs, explicit_parameters
from ..core.releases import cache_arg
from ..core.tree import TokenTree
from ..core.verdict import Verdict
from ..kernels.lean_pass import LeanPass
from ..runtime.attention import AttentionLayout, keeps_state
from ..runtime.devices import PassClock, execution_device
from ..runtime.faster_call import FasterCall, compile_events
from ..runtime.model_info import embeddable, fit_vocabulary
from ..runtime.pass_shapes import PaddedPass, PassShapes, padded_inputs

LEAN_CATCH_UP = 16  # a catch-up over at most this many tokens takes the lean pass with a mask (longer: causal)
EAGER_CATCH_UP = 4  # on a static cache, at most this many fresh tokens join a padded pass (more: an eager pass first)


class DraftModelCounts:
    """For drafters that run a model through `self.runner`: the loop's pass counter and timer read from it."""

    runner: DraftModelRunner

    @property
    def forward_count(self) -> int:
        return self.runner.forward_count

    @property
    def forward_time(self) -> float:
        return self.runner.forward_time

    def use_inputs(self, inputs: TokenInputs) -> None:
        self.runner.token_inputs = inputs.for_model(self.runner.model)

    def use_static_cache(self, rows: int, compiled: Callable[[PreTrainedModel, StaticCache], Callable | None]) -> None:
        self.runner.use_static_cache(rows, compiled)

    def use_window(self, tokens: int | None) -> None:
        self.runner.use_window(tokens)

    @property
    def draft_pass_sizes(self) -> set[int]:
        return self.runner.shapes.sizes

    @property
    def draft_sizes_kept_eager(self) -> set[int]:
        call = self.runner.call
        return call.kept_eager() & self.runner.shapes.sizes if isinstance(call, FasterCall) else set()


class HostSequence:
    """A host copy of the sequence a drafter continues: `accept` hands it the emitted tokens, so the next `propose`
    (given that very tensor) needs no copy of the prefix back from the device; any other tensor is read once."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._tensor: torch.Tensor | None = None

    def read(self, input_ids: torch.Tensor) -> list[int]:
        """`input_ids` `(1, L)` as a list."""
        if input_ids is not self._tensor:
            self.ids, self._tensor = input_ids[0].tolist(), input_ids
        return self.ids

    def extend(self, input_ids: torch.Tensor, tokens: list[int]) -> None:
        """`input_ids` is the known sequence followed by `tokens`."""
        known = self._tensor is not None and len(self.ids) + len(tokens) == input_ids.shape[1]
        self.ids, self._tensor = (self.ids + tokens, input_ids) if known else ([], None)


def emitted_tokens(tree: TokenTree, verdict: Verdict) -> list[int]:
    """What the loop appended after `tree`'s root: the accepted drafted tokens, then the bonus token (the verdict's,
    where the step gave it them: a drafter that never read its tree's tokens reads nothing here)."""
    if verdict.tokens is not None:
        return list(verdict.tokens)
    tokens = tree.host(tokens=True).tokens
    return [tokens[node] for node in verdict.path[1:]] + [verdict.bonus_token]


class DraftModelRunner:
    """Runs `model` over committed tokens and tree nodes, keeping its KV cache between steps.

    With `vocab` (the target's output rows), logits come over the target's vocabulary (`fit_vocabulary`), and ids
    the draft cannot embed are fed as a stand-in (`embeddable`): pairs whose vocabularies differ by padding work.
    Logits stay on the draft's device; the committed tokens are kept on the host (a list), so catching up with the
    sequence compares lists, never reads the device.
    """

    def __init__(self, model: PreTrainedModel, vocab: int | None = None) -> None:
        self.model = model
        self.vocab = vocab
        self.input_rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
        self.layout = AttentionLayout.of(model)
        self.recurrent = keeps_state(model)  # chains only, on the model's own cache layers (see the module's notes)
        self.cache = DynamicCache(config=model.config) if self.recurrent else DynamicCache()  # else full length
        if self.recurrent:
            record_states(self.cache, 1)
        self.device = execution_device(model)  # where inputs go: accelerate's execution device if offloaded
        self.clock = PassClock(self.device)
        self.committed: list[int] = []  # token id at each committed cache position
        self.window: int | None = None  # the most prompt tokens the draft reads (`use_window`); None: all
        self.dropped = 0  # leading tokens of the sequence the draft never reads (the prompt's beyond the window)
        self.num_nodes = 0  # tree-node slots after the committed positions
        self.node_positions = torch.empty(0, dtype=torch.long)  # position of each tree-node slot (host)
        self.forward_count = 0
        self.untimed_passes = 0  # passes that compiled a graph or ran a compile trial (`core.faster_call`)
        self.token_inputs = TokenInputs()  # the call's token types, placed by position (`use_inputs`)
        self.keeps_logits = "logits_to_keep" in explicit_parameters(model)  # else the runner slices them itself
        self.shapes = PassShapes()  # a dynamic cache: passes keep their own shapes
        self.call: Callable = model  # what runs the padded passes on a static cache (a compiled call, or the model)
        self.lean = LeanPass.of(model, self.layout.layer_types)  # masked eager passes without the wrapper, or None

    def use_window(self, tokens: int | None) -> None:
        """Read only the prompt's last `tokens` tokens (None: all of it), from the next call's first pass on."""
        self.window = tokens

    def use_static_cache(self, rows: int, compiled: Callable[[PreTrainedModel, StaticCache], Callable | None]) -> None:
        """Decode on a static cache of at least `rows` rows from here on (the draft's own, kept on the model between
        calls, grown when a call needs more; every layer full length). `compiled(model, cache)` gives the compiled
        call the padded passes run through, or None (eager)."""
        cache = getattr(self.model, "_hf_specdec_static_cache", None)
        if cache is None or static_capacity(cache) < rows:
            cache = full_length_cache(StaticCache(config=self.model.config, max_cache_len=rows), capacity=rows)
            self.model._hf_specdec_static_cache = cache
        keep_positions(cache, 0, [])  # a new call: nothing committed yet
        self.cache, self.committed, self.num_nodes = cache, [], 0
        self.node_positions = self.node_positions[:0]
        self.shapes = PassShapes(static_capacity(cache), self.shapes.sizes)
        call = compiled(self.model, cache)
        self.call = self.model if call is None else FasterCall(self.model, call, self.device)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_to_keep: int = 0, padded: bool = False,
        **kwargs: torch.Tensor,
    ) -> torch.Tensor:
        """float32 logits, on the draft's device, of one pass over `input_ids` `(len,)` at `positions`: all rows, or
        the last `logits_to_keep` if > 0. A `padded` pass (fixed shapes) runs through `self.call`."""
        self.clock.start()
        events = compile_events(self.call)
        device = self.device
        kept = {"logits_to_keep": logits_to_keep} if self.keeps_logits and logits_to_keep else {}
        ids = embeddable(input_ids.to(device), self.input_rows)[None]
        position_ids = self.layout.model_positions(positions)[None]
        extra = self.token_inputs.at(positions + self.dropped, device)  # by place in the sequence, not the window
        with torch.no_grad():
            if self.lean is not None and not padded and not extra and list(kwargs) == ["attention_mask"]:
                logits = self.lean(ids, position_ids, _to(kwargs["attention_mask"], device), self.cache,
                                   logits_to_keep)[0]
            else:
                out = (self.call if padded else self.model)(
                    input_ids=ids,
                    position_ids=position_ids,
                    **cache_arg(self.cache),
                    use_cache=True,
                    **extra,
                    **{name: _to(value, device) for name, value in kwargs.items()},
                    **kept,
                )
                logits = out.logits[0, -logits_to_keep:] if logits_to_keep else out.logits[0]
        logits = fit_vocabulary(logits.float(), self.vocab)
        self.clock.stop()
        self.forward_count += 1
        # a pass that compiled or tried its size both ways took more than a pass: cost models skip it
        self.untimed_passes += compile_events(self.call) != events
        return logits

    @property
    def forward_time(self) -> float:
        """Seconds spent in this runner's passes (on CUDA, read from events: asking waits for the last pass)."""
        return self.clock.total

    def _catch_up(self, ids: list[int]) -> list[int]:
        """Drop tree slots and the committed tokens `ids` does not share; the tokens still to feed.

        Keeps the longest common prefix (minus at least the last token, whose logits are needed), so a context
        that diverged (a new prompt, a rejected draft) costs one pass over the new tokens only.
        """
        n = min(len(self.committed), len(ids) - 1)
        common = next((i for i in range(n) if self.committed[i] != ids[i]), n)
        keep_positions(self.cache, common, [])
        self.committed, self.num_nodes = self.committed[:common], 0
        self.node_positions = self.node_positions[:0]
        return ids[common:]

    def sync(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Make the committed part equal `ids` `(L,)`, feeding only what the cache lacks; the logits of ids[-1]."""
        empty = torch.empty(0, dtype=torch.long)
        root_logits, _ = self.forward_tree(empty, empty, torch.empty(0, 0, dtype=torch.bool), ids)
        return root_logits

    def forward_tree(
        self,
        tokens: torch.Tensor,
        depths: torch.Tensor,
        sees: torch.Tensor,
        ids: torch.Tensor | list[int] | None = None,
        level: Hashable | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One pass over `k` tree nodes; with `ids`, first make the committed part equal `ids` in the same pass.

        `tokens` is `(k,)` (on any device); `depths` `(k,)` (depth 1 = a child of the root, the last committed token)
        and `sees` `(k, num_nodes + k)` bool are host tensors: each node's forwarded ancestors among the earlier slots
        *and* among this pass's nodes (a node always sees itself). Positions and masks are built on the host and
        cross once, but for a static cache's pass over nodes alone named by `level` (a key: the same key, the same
        depths, sees and earlier node rows, as a fixed shape's levels are every step), built on the device from the
        level's rows kept for the call. With `ids` (a list, or a tensor read once), earlier slots are dropped first
        (num_nodes = 0). The nodes take the next k slots. Returns the logits of `ids[-1]` (None without `ids`) and the
        nodes' logits `(k, vocab)`, on the draft's device.
        """
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        if ids is not None:
            ids = self._windowed(ids)
        fresh = self._catch_up(ids) if ids is not None else []
        if k := len(tokens):
            fresh = self._feed_eagerly(fresh)
        past, old, m = len(self.committed), self.num_nodes, len(fresh)
        device = self.device
        positions = torch.cat([torch.arange(past, past + m), past + m - 1 + depths])  # host
        fed = tokens.to(device, non_blocking=True)
        if m:
            fed = torch.cat([torch.tensor(fresh, dtype=torch.long).to(device, non_blocking=True), fed])
        if self.recurrent:  # a chain: one node a pass that sees every earlier slot, so a plain causal pass
            if k > 1 or not bool(sees[:, :old].all()):
                raise ValueError("A draft with recurrent state drafts chains only (one node a pass).")
            if m + k > 1:  # the state after each fed token, on a cache that has seen tokens already
                record_states(self.cache, m + k if cache_length(self.cache) else 1)
            logits = self._forward(fed, positions.to(device, non_blocking=True), logits_to_keep=k + (1 if m else 0))
        elif k == 0 and (self.lean is None or m > LEAN_CATCH_UP or self.shapes.width is not None):
            # catching up only: a plain causal pass (the model applies any window), the last row's logits
            logits = self._forward(fed, positions.to(device, non_blocking=True), logits_to_keep=1)
        elif self.shapes.width is not None:  # a static cache: fixed shapes, every row's logits, padding dropped
            size = self.shapes.size(m + k)
            self._make_room(past + old + size)
            if m or level is None:  # committed tokens caught up in the same pass, or an unnamed level: the host
                allowed, keys = self._allowed(sees, m), self._key_positions(positions)
                padded = padded_inputs(fed, positions, allowed, keys, size, self.shapes.width, self.layout,
                                       self.model.dtype, device)
            else:  # a named level of nodes: from the level's rows kept on the device, whatever the past
                padded = self._level_inputs(level, fed, depths, sees, size)
            logits = self._forward(padded.tokens[0], padded.positions[0], padded=True,
                                   attention_mask=padded.masks)[m - 1 if m else 0 : m + k]
            keep_positions(self.cache, past + old + m + k, [])  # the padding rows
        else:  # tree nodes, or a short catch-up (a step's bonus token) for the lean pass: under the mask built here
            mask = self.layout.masks(self._allowed(sees, m), positions, self._key_positions(positions),
                                     self.model.dtype, device)
            logits = self._forward(fed, positions.to(device, non_blocking=True), logits_to_keep=k + (1 if m else 0),
                                   attention_mask=mask)
        if ids is not None:
            self.committed = list(ids)
        self.num_nodes = old + k
        self.node_positions = torch.cat([self.node_positions, positions[m:]])
        return (logits[0] if m else None), logits[len(logits) - k :]

    def _windowed(self, ids: list[int]) -> list[int]:
        """The part of the sequence `ids` the draft reads. With nothing committed (a call's first pass), the window
        is placed: the prompt's first `len(ids) - window` tokens are dropped for the rest of the call."""
        if not self.committed:
            self.dropped = max(0, len(ids) - self.window) if self.window else 0
        return ids[self.dropped :]

    def _level_inputs(self, level: Hashable, fed: torch.Tensor, depths: torch.Tensor, sees: torch.Tensor, size: int
                      ) -> PaddedPass:
        """Inputs of a padded pass over the level of nodes named `level` (`fed` on the device, at `depths`, seeing
        `sees`) after the committed tokens and the node rows forwarded so far, positions and masks built on the device
        from the level's rows (`PassShapes.padded_level`, kept for the call)."""
        past = len(self.committed)
        earlier = self.node_positions - (past - 1)  # the depths of the node rows forwarded before (host arithmetic)
        rows = self.shapes.padded_level(level, depths, sees, earlier, size, self.device)
        positions, masks = rows.inputs(past, self.shapes.width, self.layout, self.model.dtype, origin=past - 1)
        tokens = torch.cat([fed, fed[:1].expand(size - len(fed))])
        return PaddedPass(tokens[None], positions[None], masks)

    def _make_room(self, rows: int) -> None:
        """Let the static cache hold `rows` rows: if it cannot, move its rows into one twice as large (new buffers,
        so a compiled call compiles again: a step that forwards more nodes than the room given is rare)."""
        if rows <= self.shapes.width:
            return
        width = max(rows, 2 * self.shapes.width)
        self.cache.layers[:] = [static_copy(layer, width) for layer in self.cache.layers]
        self.shapes = PassShapes(width, self.shapes.sizes)

    def _feed_eagerly(self, fresh: list[int]) -> list[int]:
        """On a static cache, commit all but the last `EAGER_CATCH_UP` of `fresh` in an eager pass of its own (a long
        catch-up would otherwise pad to a large new shape); the tokens left for the padded pass."""
        if self.shapes.width is None or len(fresh) <= EAGER_CATCH_UP:
            return fresh
        early, fresh = fresh[:-EAGER_CATCH_UP], fresh[-EAGER_CATCH_UP:]
        past = len(self.committed)
        self._forward(torch.tensor(early, dtype=torch.long), torch.arange(past, past + len(early), device=self.device),
                      logits_to_keep=1)
        self.committed = self.committed + early
        return fresh

    def _allowed(self, sees: torch.Tensor, m: int) -> torch.Tensor:
        """`(m + k, past + old + m + k)` bool on the host: which key each fed token sees (the `m` fresh committed
        tokens causally, the `k` nodes the committed part, the fresh tokens and what `sees` says). A few ops: a
        draft pass runs this every time, so each op counts."""
        past, old, k = len(self.committed), self.num_nodes, sees.shape[0]
        assert not (m and old), "fresh committed tokens come with a catch-up, which drops the node slots"
        ones = torch.ones(k, past + m, dtype=torch.bool)  # nodes see the committed part and the fresh tokens
        nodes = torch.cat([ones, sees[:, :old], sees[:, old:] | torch.eye(k, dtype=torch.bool)], dim=1)
        if not m:
            return nodes
        fresh = torch.ones(m, past + m + k, dtype=torch.bool).tril_(past)  # causal among themselves, no node
        return torch.cat([fresh, nodes])

    def _key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Position of every key of a pass (host): the committed tokens, the earlier node slots, then the fed ones."""
        return torch.cat([torch.arange(len(self.committed)), self.node_positions, positions])

    def commit(self, ids: list[int] | torch.Tensor, slots: list[int] | torch.Tensor) -> None:
        """`ids` `(L,)` is the new context; `slots` are the forwarded nodes of its accepted path, root side first.

        Those slots become committed positions; every other node is dropped.
        """
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        ids = ids[self.dropped :]
        slots = slots.tolist() if isinstance(slots, torch.Tensor) else slots
        past = len(self.committed)
        keep_positions(self.cache, past, [past + int(s) for s in slots])
        self.committed = list(ids[: past + len(slots)])
        self.num_nodes = 0
        self.node_positions = self.node_positions[:0]


def _to(value: torch.Tensor | dict[str, torch.Tensor], device: torch.device):
    """A tensor, or a dict of masks by layer type, on `device`."""
    if isinstance(value, dict):
        return {name: mask.to(device) for name, mask in value.items()}
    return value.to(device)


def forwarded_prefix(slots: list[int]) -> list[int]:
    """The leading run of `slots` that are >= 0: the part of an accepted path the draft already forwarded."""
    return list(itertools.takewhile(lambda slot: slot >= 0, slots))
