"""The TokenTree value: drafted tokens, their parents and everything attention needs.

Drafters store nodes in breadth-first order; off the CPU the loop hands the target and the verifier a depth-first
one (`core.pass_shapes.depth_first`). Both keep a parent before its children, all that is relied on, and node 0 is
the root: the last token already accepted, whose logits propose the first drafted level. Siblings keep their
drafting order, which verifiers rely on (the first-drafted child is tried first).
Everything is built with tensor ops whose count grows with depth, never with the node count,
so trees of thousands of nodes stay cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class HostTree:
    """A tree's parents (and tokens, once known) as Python lists: what the host decides with (the walk down, the
    emitted tokens, statistics). Drafters pass in what they know; `TokenTree.host` reads the rest, once."""

    parents: list[int]
    tokens: list[int] | None = None
    _structure: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def depths(self) -> list[int]:
        depths = [0] * len(self.parents)
        for node in range(1, len(self.parents)):
            depths[node] = depths[self.parents[node]] + 1
        return depths

    def structure(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(depths (n,), ancestors (n, n) bool)` as CPU tensors (see `TokenTree.ancestors`), built once.

        Pointer jumping one level per iteration: O(depth) tensor ops, never O(n). Built here, on the host, a GPU
        tree gets them in two copies instead of O(depth) launches, and masks can be built before any copy.
        """
        if self._structure is None:
            depth_list = self.depths()
            parents = torch.tensor(self.parents, dtype=torch.long)
            rows = torch.arange(len(parents))
            ancestors = torch.eye(len(parents), dtype=torch.bool)
            current = parents.clone()
            for _ in range(max(depth_list)):
                alive = current >= 0
                ancestors[rows, current.clamp(min=0)] |= alive
                current = torch.where(alive, parents[current.clamp(min=0)], current)
            self._structure = torch.tensor(depth_list, dtype=torch.long), ancestors
        return self._structure

    def visibility(self, past_length: int) -> torch.Tensor:
        """`TokenTree.visibility` on the host (every node sees the whole past)."""
        _, ancestors = self.structure()
        allowed = torch.ones(len(self.parents), past_length + len(self.parents), dtype=torch.bool)
        allowed[:, past_length:] = ancestors
        return allowed

    def children(self) -> list[list[int]]:
        """Each node's children, in drafting order."""
        out: list[list[int]] = [[] for _ in self.parents]
        for node in range(1, len(self.parents)):
            out[self.parents[node]].append(node)
        return out

    def depth_first(self) -> list[int]:
        """The nodes in depth-first preorder, siblings in drafting order: every first-child path from the root is a
        run of consecutive places, and parents still come before their children."""
        children, order, stack = self.children(), [], [0]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(children[node]))
        return order


@dataclass
class TokenTree:
    """A tree of token ids rooted at the last accepted token.

    Attributes:
        tokens: `(n,)` long tensor, `tokens[0]` is the root; -1 marks a node its drafter could not fill (fewer
            candidates than its shape wanted), which no verifier accepts (it matches no token and has no draft mass)
            and whose children are -1 too; a model is fed `input_tokens` (such a node as token 0).
        parents: `(n,)` long tensor, `parents[0] == -1`, `parents[i] < i` otherwise.
        draft_probs: optional `(n, vocab)` tensor: row i is the (processed) draft distribution the children
            of node i were drawn from (zero for childless nodes). Sampling verifiers need it; greedy and
            target-matching do not. A drafter may hand out a buffer it reuses: valid until its next proposal.
        draft_columns: optional `(n, w)` long tensor: row i holds columns outside of which `draft_probs[i]` is zero
            (a draft sampling after a top-k), so a verifier can work on those columns (and the target's) alone.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    draft_columns: torch.Tensor | None = None
    _depths: torch.Tensor | None = field(default=None, repr=False)
    _ancestors: torch.Tensor | None = field(default=None, repr=False)
    _host: HostTree | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.parents.shape != self.tokens.shape:
            raise ValueError("TokenTree wants 1-D `tokens` and `parents` of equal length.")
        parents = self.host().parents  # checked on the host copy: no extra device reads
        if parents[0] != -1:
            raise ValueError("TokenTree node 0 must be the root (parent -1).")
        if any(not 0 <= parent < node for node, parent in enumerate(parents[1:], 1)):
            raise ValueError("TokenTree nodes must come after their parents: 0 <= parents[i] < i for i > 0.")

    def to(self, device: torch.device) -> TokenTree:
        """This tree on `device` (itself when already there), its host copy and cached structure kept."""
        if self.tokens.device == torch.device(device) and self.parents.device == torch.device(device):
            return self

        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device)

        return TokenTree(tokens=move(self.tokens), parents=move(self.parents), draft_probs=self.draft_probs,
                         draft_columns=self.draft_columns,
                         _depths=move(self._depths), _ancestors=move(self._ancestors), _host=self._host)

    def host(self, tokens: bool = False) -> HostTree:
        """Parents (with `tokens`, tokens too) as Python lists, each read from the device at most once per tree."""
        if self._host is None and tokens:
            parents, token_list = torch.stack([self.parents, self.tokens.to(self.parents.device)]).tolist()
            self._host = HostTree(parents=parents, tokens=token_list)
        elif self._host is None:
            self._host = HostTree(parents=self.parents.tolist())
        elif tokens and self._host.tokens is None:
            self._host.tokens = self.tokens.tolist()
        return self._host

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def input_tokens(self) -> torch.Tensor:
        """`tokens` as a model is fed them: an unfilled node (-1) as token 0 (never accepted, its outputs unused)."""
        return self.tokens.clamp(min=0)

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def depths(self) -> torch.Tensor:
        """Depth of each node, root = 0."""
        if self._depths is None:
            self._walk_up()
        return self._depths

    @property
    def max_depth(self) -> int:
        return max(self.host().depths())

    @property
    def ancestors(self) -> torch.Tensor:
        """`(n, n)` bool: `ancestors[i, j]` is True when j is i or an ancestor of i."""
        if self._ancestors is None:
            self._walk_up()
        return self._ancestors

    def _walk_up(self) -> None:
        depths, ancestors = self.host().structure()  # from the host's parents (read once), then one copy each
        self._depths = depths.to(self.device, non_blocking=True)
        self._ancestors = ancestors.to(self.device, non_blocking=True)

    def children(self, node: int) -> torch.Tensor:
        """Indices of the children of `node`, in drafting order."""
        return torch.nonzero(self.parents == node).flatten()

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`, both included."""
        path = []
        parents = self.host().parents
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def position_ids(self, past_length: int) -> torch.Tensor:
        """`(1, n)` position ids: each node sits one position after its parent."""
        return (self.depths + past_length).unsqueeze(0)

    def visibility(self, past_length: int, past_visible: torch.Tensor | None = None) -> torch.Tensor:
        """`(n, past_length + n)` bool: True where a node may look.

        Every node sees the whole past (or the positions `past_visible` marks) and its own ancestors. Built on the
        host (`HostTree.visibility`) and copied once.
        """
        allowed = self.host().visibility(past_length).to(self.device, non_blocking=True)  # a fresh tensor: writable
        if past_visible is not None:
            allowed[:, :past_length] = past_visible
        return allowed

    def attention_mask(
        self, past_length: int, dtype: torch.dtype, past_visible: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Additive `(1, 1, n, past_length + n)` mask of `visibility`: 0 where a node may look, dtype's min elsewhere.

        For a model with full attention in every layer; `core.attention.AttentionLayout.tree_masks` adds
        sliding windows where a model has them.
        """
        return additive_mask(self.visibility(past_length, past_visible), dtype)

    def prefix_tokens(self, nodes: list[int] | torch.Tensor) -> torch.Tensor:
        """`(len(nodes), d + 1)` token ids from the root to each node; all nodes must share depth d."""
        nodes = nodes.tolist() if isinstance(nodes, torch.Tensor) else nodes
        d = self.host().depths()[nodes[0]]
        out = torch.empty(len(nodes), d + 1, dtype=self.tokens.dtype, device=self.device)
        current = torch.tensor(nodes).to(self.device)
        for level in range(d, -1, -1):
            out[:, level] = self.tokens[current]
            current = self.parents[current].clamp(min=0)
        return out

    def select(self, keep: torch.Tensor | list[int]) -> TokenTree:
        """The nodes `keep` (root first, closed under taking parents, each after its parent), renumbered in that
        order. Given as a list, the host copy follows without a read."""
        host = None
        if isinstance(keep, list) and self._host is not None:
            new = {old: i for i, old in enumerate(keep)}
            tokens = self._host.tokens
            host = HostTree(parents=[new.get(self._host.parents[old], -1) for old in keep],
                            tokens=[tokens[old] for old in keep] if tokens is not None else None)
        keep = torch.as_tensor(keep, dtype=torch.long).to(self.device, non_blocking=True)
        probs = self.draft_probs[keep] if self.draft_probs is not None else None
        columns = self.draft_columns[keep] if self.draft_columns is not None else None
        parents = (torch.tensor(host.parents, dtype=torch.long).to(self.device, non_blocking=True) if host is not None
                   else renumber_parents(self.parents, keep))  # known on the host: one copy, no renumbering launches
        return TokenTree(tokens=self.tokens[keep], parents=parents, draft_probs=probs, draft_columns=columns,
                         _host=host)

    @classmethod
    def from_parents(cls, tokens: list[int] | torch.Tensor, parents: list[int] | torch.Tensor, **kwargs) -> TokenTree:
        if isinstance(parents, list) and "_host" not in kwargs:  # known on the host already: never read back
            kwargs["_host"] = HostTree(parents=list(parents), tokens=list(tokens) if isinstance(tokens, list) else None)
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        parents = torch.as_tensor(parents, dtype=torch.long, device=tokens.device)
        return cls(tokens=tokens, parents=parents, **kwargs)

    @classmethod
    def from_paths(cls, root: int, paths: list[tuple[int, ...]]) -> TokenTree:
        """A tree (breadth-first, siblings contiguous, in first-listed order) from root-less token paths.

        Duplicate paths are merged; a path's prefixes must be listed too (in any order).
        """
        index: dict[tuple[int, ...], int] = {(): 0}
        children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for path in paths:
            if path not in index:
                index[path] = -1
                children.setdefault(path[:-1], []).append(path)
        tokens, parents, queue = [int(root)], [-1], [()]
        for path in queue:  # grows while iterated: a breadth-first walk
            for child in children.get(path, []):
                index[child] = len(tokens)
                tokens.append(child[-1])
                parents.append(index[path])
                queue.append(child)
        return cls.from_parents(tokens, parents)


# --- operations on (parents, ...) arrays that trees under construction share with TokenTree ---------------------


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`(1, 1, q, kv)` additive mask from a `(q, kv)` bool matrix: 0 where allowed, dtype's min elsewhere.

    A float mask, not a bool one: eager attention silently misreads bool 4-D masks.
    """
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def renumber_parents(parents: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Parents of the nodes `keep` (sorted, closed under taking parents) in the numbering of the kept nodes."""
    index = torch.full((len(parents),), -1, dtype=torch.long, device=parents.device)
    index[keep] = torch.arange(len(keep), device=parents.device)
    kept = parents[keep]
    return torch.where(kept >= 0, index[kept.clamp(min=0)], -1)


def breadth_first_order(parents: torch.Tensor, depths: torch.Tensor, priority: torch.Tensor) -> torch.Tensor:
    """The permutation that lists nodes breadth first with siblings contiguous, highest `priority` first.

    Nodes may come in any order where parents precede children (creation order). Level by level, a node's
    children follow the order their parents got; among siblings, higher priority first (ties: earlier node).
    `order[i]` is the old index of the node that goes to place i; apply it with `reorder`.
    """
    new_index = torch.zeros(len(parents), dtype=torch.long)
    order, placed = [torch.tensor([0])], 1
    for depth in range(1, int(depths.max()) + 1 if len(depths) else 1):
        level = torch.nonzero(depths == depth).flatten()
        level = level[torch.argsort(-priority[level], stable=True)]
        level = level[torch.argsort(new_index[parents[level]], stable=True)]
        new_index[level] = torch.arange(placed, placed + len(level))
        order.append(level)
        placed += len(level)
    return torch.cat(order)


def reorder(parents: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Parents after moving node `order[i]` to place i (every node kept)."""
    index = torch.empty_like(order)
    index[order] = torch.arange(len(order))
    moved = parents[order]
    return torch.where(moved >= 0, index[moved.clamp(min=0)], -1)
