"""The TokenTree value: drafted tokens, their parents and everything attention needs.

Nodes are stored in breadth-first order (a parent always comes before its children) and node 0
is the root: the last token already accepted, whose logits propose the first drafted level.
Siblings keep their drafting order, which verifiers rely on (the first-drafted child is tried first).
Everything is built with tensor ops whose count grows with depth, never with the node count,
so trees of thousands of nodes stay cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenTree:
    """A tree of token ids rooted at the last accepted token.

    Attributes:
        tokens: `(n,)` long tensor, `tokens[0]` is the root.
        parents: `(n,)` long tensor, `parents[0] == -1`, `parents[i] < i` otherwise.
        draft_probs: optional `(n, vocab)` tensor: row i is the (processed) draft distribution the children
            of node i were drawn from. Sampling verifiers need it; greedy and target-matching do not.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    _depths: torch.Tensor | None = field(default=None, repr=False)
    _ancestors: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.parents.shape != self.tokens.shape:
            raise ValueError("TokenTree wants 1-D `tokens` and `parents` of equal length.")
        if int(self.parents[0]) != -1:
            raise ValueError("TokenTree node 0 must be the root (parent -1).")
        idx = torch.arange(len(self.parents), device=self.parents.device)
        if len(self.parents) > 1 and not bool((self.parents[1:] < idx[1:]).all() & (self.parents[1:] >= 0).all()):
            raise ValueError("TokenTree nodes must be in breadth-first order: 0 <= parents[i] < i for i > 0.")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

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
        return int(self.depths.max())

    @property
    def ancestors(self) -> torch.Tensor:
        """`(n, n)` bool: `ancestors[i, j]` is True when j is i or an ancestor of i."""
        if self._ancestors is None:
            self._walk_up()
        return self._ancestors

    def _walk_up(self) -> None:
        # Pointer jumping one level per iteration: O(depth) tensor ops.
        n = len(self)
        rows = torch.arange(n, device=self.device)
        ancestors = torch.eye(n, dtype=torch.bool, device=self.device)
        depths = torch.zeros(n, dtype=torch.long, device=self.device)
        current = self.parents.clone()
        while bool((current >= 0).any()):
            alive = current >= 0
            ancestors[rows[alive], current[alive]] = True
            depths += alive.long()
            current = torch.where(alive, self.parents[current.clamp(min=0)], current)
        self._depths, self._ancestors = depths, ancestors

    def children(self, node: int) -> torch.Tensor:
        """Indices of the children of `node`, in drafting order."""
        return torch.nonzero(self.parents == node).flatten()

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`, both included."""
        path = []
        parents = self.parents.tolist()
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def position_ids(self, past_length: int) -> torch.Tensor:
        """`(1, n)` position ids: each node sits one position after its parent."""
        return (self.depths + past_length).unsqueeze(0)

    def attention_mask(
        self, past_length: int, dtype: torch.dtype, past_visible: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Additive `(1, 1, n, past_length + n)` mask: 0 where a node may look, dtype's min elsewhere.

        Every node sees the whole past (or the positions `past_visible` marks) and its own ancestors.
        A float mask, not a bool one: eager attention silently misreads bool 4-D masks.
        """
        n = len(self)
        allowed = torch.ones(n, past_length + n, dtype=torch.bool, device=self.device)
        if past_visible is not None:
            allowed[:, :past_length] = past_visible
        allowed[:, past_length:] = self.ancestors
        mask = torch.zeros(n, past_length + n, dtype=dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]

    def prefix_tokens(self, nodes: torch.Tensor) -> torch.Tensor:
        """`(len(nodes), d + 1)` token ids from the root to each node; all nodes must share depth d."""
        d = int(self.depths[nodes[0]])
        out = torch.empty(len(nodes), d + 1, dtype=self.tokens.dtype, device=self.device)
        current = nodes.clone()
        for level in range(d, -1, -1):
            out[:, level] = self.tokens[current]
            current = self.parents[current].clamp(min=0)
        return out

    @classmethod
    def from_parents(cls, tokens: list[int] | torch.Tensor, parents: list[int] | torch.Tensor, **kwargs) -> TokenTree:
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        parents = torch.as_tensor(parents, dtype=torch.long, device=tokens.device)
        return cls(tokens=tokens, parents=parents, **kwargs)
