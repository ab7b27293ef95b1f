"""Fixed shapes for the target's tree passes on a static cache, so a compiled forward reuses a few graphs.

On a `StaticCache` every layer returns all `max_cache_len` rows, so the masks are that wide whatever the past
length; positions are past + depth (a tensor, not a shape). What is left to vary is the node count: the tree handed
to the target is padded to a power-of-two bucket (a fixed-shape method's tree keeps one size for the whole call;
a best-first one lands in a few buckets). Padding nodes are the root's token at the root's position, each seeing
only itself; their rows are written past the tree and dropped by the compaction, their logits never read. Near the
cache's end the tree loses whole levels until its bucket fits the rows left (`fit_tree`), so the sizes stay powers
of two: at most log2(max_cache_len) + 1 graphs, in practice the tree's own bucket and a few smaller ones in the
last steps (a larger `max_cache_len` keeps the last trees whole). This module decides shapes only: no drafter sizes
its trees for it, so any method's trees get the same treatment.

The target's padded pass builds its positions and masks on the device, with fixed shapes, from the shape (kept per
call, `PaddedTree`) and the past length, which may be a device scalar: no host-built mask crosses each step, and a
step captured whole can build them too. So do the draft's padded passes over a level of tree nodes
(`PaddedTree.level`: the level's nodes also see some of the node rows forwarded before them): a host-built mask copied
from pageable memory makes a CUDA stream wait for the work queued before it, once per draft level. A draft pass that
also catches up with committed tokens builds its inputs on the host (`padded_inputs`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from ..core.tree import TokenTree
from .attention import SLIDING, AttentionLayout, Masks

#: padded tree shapes a call keeps on the device (`PassShapes.padded_tree`): a fixed shape needs one, a sized method
#: its menu's few; a best-first method's new shape every step replaces the oldest
KEPT_TREES = 64


def padded_size(nodes: int) -> int:
    """The power of two holding `nodes` rows: what a pass on a static cache is padded to."""
    return 1 << max(nodes - 1, 0).bit_length()


@dataclass
class PassShapes:
    """How one call shapes its tree passes: `width` is the static cache's rows (None: a dynamic cache, no padding);
    `sizes` the padded node counts used so far (each is one graph for a compiled forward)."""

    width: int | None = None
    sizes: set[int] = field(default_factory=set)
    _trees: dict = field(default_factory=dict, repr=False)  # (parents, size, device) -> PaddedTree

    def rows(self, past: int) -> int | None:
        """How many nodes a tree after `past` cached tokens may keep: the largest bucket the rows left can hold."""
        if self.width is None:
            return None
        left = self.width - past
        return 1 << (left.bit_length() - 1) if left > 0 else 0

    def size(self, nodes: int) -> int:
        """The padded node count of a pass over `nodes` nodes: the smallest power of two holding them."""
        if self.width is None:
            return nodes
        size = padded_size(nodes)
        self.sizes.add(size)
        return size

    def padded_tree(self, tree: TokenTree, size: int, device: torch.device) -> PaddedTree:
        """`tree`'s shape padded to `size` nodes on `device`, made once per shape (a few copies) and kept."""
        key = (tuple(tree.host().parents), size, torch.device(device))
        return self._kept(key, lambda: PaddedTree.of(tree, size, device))

    def padded_level(self, level: Hashable, depths: torch.Tensor, sees: torch.Tensor, earlier: torch.Tensor,
                     size: int, device: torch.device) -> PaddedTree:
        """A draft level's nodes padded to `size` rows on `device` (`PaddedTree.level`), made once per `level` (a key
        the drafter gives: the same key, the same depths, sees and earlier rows) and kept: a fixed shape's levels are
        the same every step, and naming them spares reading the host tensors to compare them."""
        key = ("level", level, len(earlier), size, torch.device(device))
        return self._kept(key, lambda: PaddedTree.level(depths, sees, earlier, size, device))

    def _kept(self, key: tuple, make) -> PaddedTree:
        if key not in self._trees:
            if len(self._trees) >= KEPT_TREES:
                del self._trees[next(iter(self._trees))]
            self._trees[key] = make()
        return self._trees[key]


@dataclass(frozen=True)
class PaddedPass:
    """The target inputs of one pass over a tree padded to `size` nodes."""

    tokens: torch.Tensor  # (1, size)
    positions: torch.Tensor  # (1, size)
    masks: Masks


@dataclass(frozen=True)
class PaddedTree:
    """The rows of a pass padded to `size`, on the model's device: all its positions and masks need besides the past
    length. The pass's rows are written after the `past` committed rows and any node rows forwarded before them
    (a draft's earlier levels): `block` says which of those rows (`span` of them, from row `past` on) each sees; every
    row of the pass but padding sees the whole committed past. Positions are an origin (the committed length, or one
    less for a draft, whose depth-1 nodes follow its last committed token) plus depths; padding rows sit at the first
    row's position, each seeing only itself."""

    depths: torch.Tensor  # (size,) long: of the pass's rows
    block: torch.Tensor  # (size, span) bool: which rows from `past` on each row sees (ancestry; padding: itself)
    nodes: torch.Tensor  # (size, 1) bool: the pass's own rows, not padding
    key_depths: torch.Tensor  # (span,) long: the depths of the rows from `past` on (earlier node rows, then these)

    @classmethod
    def of(cls, tree: TokenTree, size: int, device: torch.device) -> PaddedTree:
        """A target's pass over `tree` (its root at the origin)."""
        depths, ancestors = tree.host().structure()
        return cls._padded(depths, ancestors, torch.empty(0, dtype=torch.long), size, device)

    @classmethod
    def level(cls, depths: torch.Tensor, sees: torch.Tensor, earlier: torch.Tensor, size: int, device: torch.device
              ) -> PaddedTree:
        """A draft's pass over one level of nodes at `depths` `(k,)` (host), each seeing what `sees` `(k, old + k)`
        says among the `old` node rows forwarded before it (at depths `earlier` `(old,)`) and among its own rows,
        and itself (the runner's `forward_tree` without committed tokens to catch up)."""
        k, old = len(depths), len(earlier)
        block = torch.cat([sees[:, :old], sees[:, old:] | torch.eye(k, dtype=torch.bool)], dim=1)
        return cls._padded(depths, block, earlier, size, device)

    @classmethod
    def _padded(cls, depths: torch.Tensor, block: torch.Tensor, earlier: torch.Tensor, size: int,
                device: torch.device) -> PaddedTree:
        k, old = len(depths), len(earlier)
        padded = torch.zeros(size, old + size, dtype=torch.bool)
        padded[:k, : old + k] = block
        padded[k:, old + k :] = torch.eye(size - k, dtype=torch.bool)
        depths = torch.cat([depths, depths[:1].expand(size - k)])
        nodes = (torch.arange(size) < k)[:, None]
        key_depths = torch.cat([earlier.to(depths.dtype), depths])
        return cls(*(t.to(device, non_blocking=True) for t in (depths, padded, nodes, key_depths)))

    def inputs(self, past: int | torch.Tensor, width: int, layout: AttentionLayout, dtype: torch.dtype,
               origin: int | torch.Tensor | None = None) -> tuple[torch.Tensor, Masks]:
        """(positions `(size,)`, masks `width` keys wide) of a pass after `past` committed rows, at positions `origin`
        (default `past`) + depth, built on the device with fixed shapes: `past` may be a device scalar (a static
        layer's write length), so nothing here waits for the host, and a captured step could build them too. The
        rows from `past` on are the earlier node rows, then this pass's; every row sees the whole past but padding,
        which sees only itself."""
        size, span, device = len(self.depths), len(self.key_depths), self.depths.device
        origin = past if origin is None else origin
        columns = torch.arange(width, device=device)
        rows = past + torch.arange(span, device=device)  # the cache rows of the earlier nodes and this pass's
        visible = (columns < past)[None] & self.nodes
        visible.scatter_(1, rows[None].expand(size, span), self.block)  # a scatter, not a gather: 20x cheaper on a CPU
        positions = origin + self.depths
        keys = columns  # only a sliding window reads them: a node's row holds its position, others are hidden
        if SLIDING in layout.layer_types:
            keys = columns.scatter(0, rows, origin + self.key_depths)
        return positions, layout.masks(visible, positions, keys, dtype, device)


def padded_pass(
    tree: TokenTree, past: int, shapes: PassShapes, layout: AttentionLayout, dtype: torch.dtype, device: torch.device,
) -> PaddedPass:
    """Inputs of a pass over `tree` (on `device`) padded to its bucket (`shapes.size`), masks `shapes.width` keys wide
    (the cache rows): positions and masks built on the device from the shape's `PaddedTree`, kept for the call."""
    size = shapes.size(len(tree))
    if past + size > shapes.width:
        raise ValueError(f"A pass over {len(tree)} nodes padded to {size} does not fit {shapes.width} cache rows after "
                         f"{past}.")
    padded = shapes.padded_tree(tree, size, device)
    tokens = tree.input_tokens.to(device, non_blocking=True)
    tokens = torch.cat([tokens, tokens[:1].expand(size - len(tokens))])
    positions, masks = padded.inputs(past, shapes.width, layout, dtype)
    return PaddedPass(tokens[None], positions[None], masks)


def padded_inputs(
    tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, key_positions: torch.Tensor, size: int,
    width: int, layout: AttentionLayout, dtype: torch.dtype, device: torch.device,
) -> PaddedPass:
    """Inputs of a pass over `q` fed tokens `(q,)` at `positions` `(q,)` padded to `size` rows, masks `width` keys
    wide: `allowed` `(q, end)` says which of the first `end` cache rows each fed token sees (the fed tokens take the
    last q of them), `key_positions` `(end,)` those rows' positions. Padding rows repeat the first fed token at its
    position, each seeing only itself; they are written at rows end, end + 1, ... (the caller drops them).
    Positions and masks are built where `allowed` is (the host, for the loop's passes) and cross once."""
    (q, end), pad = allowed.shape, size - len(tokens)
    if pad < 0 or end + pad > width:
        raise ValueError(f"A pass over {q} tokens padded to {size} does not fit {width} cache rows after {end - q}.")
    built = allowed.device
    positions = positions.to(built)
    positions = torch.cat([positions, positions[:1].expand(pad)])
    keys = torch.cat([key_positions.to(built, positions.dtype), positions[q:],
                      torch.zeros(width - end - pad, dtype=positions.dtype, device=built)])
    visible = torch.zeros(size, width, dtype=torch.bool, device=built)
    visible[:q, :end] = allowed
    visible[q:, end : end + pad] = torch.eye(pad, dtype=torch.bool, device=built)
    tokens = torch.cat([tokens, tokens[:1].expand(pad)]).to(device, non_blocking=True)
    return PaddedPass(tokens[None], positions.to(device, non_blocking=True)[None],
                      layout.masks(visible, positions, keys, dtype, device))


def fit_tree(tree: TokenTree, past: int, deepest: int | None, rows: int | None) -> tuple[TokenTree, list[int] | None]:
    """`tree` cut to whole levels: none deeper than `deepest`, and no more nodes than `rows` (what the cache's rows
    left can take); and the kept nodes (None: all kept). Whole levels leave every kept node's children intact or
    empty, so any verifier stays exact. `past` is for the error message only."""
    depths = tree.host().depths()
    limit = max(depths) if deepest is None else min(deepest, max(depths))
    if rows is not None:
        while limit >= 0 and sum(d <= limit for d in depths) > rows:
            limit -= 1
        if limit < 0:
            raise ValueError(f"The static cache is full: no row is left for the next token after {past} tokens. "
                             "Pass a larger max_cache_len.")
    if limit == max(depths):
        return tree, None
    kept = [node for node, depth in enumerate(depths) if depth <= limit]
    return tree.select(kept), kept


def orders_depth_first(device: torch.device, wanted: bool | None = None) -> bool:
    """Whether a tree for a target on `device` is handed over depth first: as `wanted` (the `depth_first` setting),
    or where it is None off the CPU only. There every cache row moved costs launches, about four per layer a step; on
    a CPU the gather of a few rows is cheaper than reordering a sampled tree's vocabulary-wide draft rows
    (`TokenTree.select`)."""
    return wanted if wanted is not None else torch.device(device).type != "cpu"


def depth_first(
    tree: TokenTree, kept: list[int] | None = None, device: torch.device | None = None, wanted: bool | None = None
) -> tuple[TokenTree, list[int] | None]:
    """`tree` with its nodes in depth-first order (siblings in drafting order) where the target's `device` wants
    it (`orders_depth_first`), and the drafted tree's node at each place (`kept`, the nodes `tree` was selected
    from, composed in; None: nothing moved).

    Why: after the pass the target's cache keeps the accepted path's rows only. A path that follows first children
    (the draft's top choice at each level, the usual accepted path) is then a run of consecutive rows, which the
    compaction keeps by cutting the tail: no row moved, where a breadth-first tree costs an index and a copy per key
    and value per layer."""
    if not orders_depth_first(device if device is not None else tree.device, wanted):
        return tree, kept
    order = tree.host().depth_first()
    if order == list(range(len(order))):
        return tree, kept
    return tree.select(order), order if kept is None else [kept[node] for node in order]
