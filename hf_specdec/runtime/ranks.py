"""Ranks that share one sharded target agree: the lowest rank decides, the others receive.

A target sharded by Transformers' tensor parallelism (`from_pretrained(..., tp_plan="auto")`,
`distributed_config=DistributedConfig(tp_size=N)`) runs every forward pass as collectives over its ranks: each rank
must feed the same tokens in the same passes. Whatever depends on a clock (tree sizes, a plan's latency curves), on
a random draw (sampled children, sampled verification) or on files (which plan is stored) would differ between
ranks, so one rank decides it and broadcasts the outcome; the others skip drafting and verifying altogether. The
broadcasts carry host values (a few integers per step), on a gloo group of the same ranks, so that no rank reads a
device tensor back for them. A model that is not sharded (one process, or data-parallel ranks decoding different
prompts) gets `ONE_PROCESS`: nothing is broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..core.tree import HostTree, TokenTree
from ..core.verdict import Verdict

T = TypeVar("T")
_HOST_GROUPS: dict[tuple[int, ...], Any] = {}  # a gloo group per set of ranks, made once per process


def sharding_mesh(model: Any) -> Any | None:
    """The device mesh a target's weights are sharded over by Transformers (its tensor-parallel axis), or None.

    Transformers marks a sharded model with `_device_mesh` and `_tp_size` (`distributed/mixin.py`); a model merely
    loaded while `torch.distributed` is initialised has neither, and its ranks decode independently.
    """
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if mesh.ndim > 1:
        if "tp" not in (mesh.mesh_dim_names or ()):
            return None
        mesh = mesh["tp"]
    return mesh if mesh.size() > 1 else None


def _host_group(group: Any, ranks: tuple[int, ...]) -> Any:
    """`group` when it is gloo already (CPU tensor parallelism), else a gloo group of the same ranks, made once by
    those ranks alone (other tensor-parallel groups of a bigger job make theirs), so host values travel on the host:
    an NCCL broadcast would need device tensors, and reading them back costs a round trip."""
    if dist.get_backend(group) == "gloo":
        return group
    if ranks not in _HOST_GROUPS:
        _HOST_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _HOST_GROUPS[ranks]


@dataclass(frozen=True)
class Ranks:
    """The processes that run one target pass together, and which of them decides."""

    group: Any = None  # a gloo process group of the target's ranks; None: the target runs in this process alone
    source: int = 0  # the global rank that decides: the lowest of the group
    deciding: bool = True  # whether this process is that rank

    @classmethod
    def of(cls, model: Any) -> Ranks:
        mesh = sharding_mesh(model)
        if mesh is None:
            return ONE_PROCESS
        group = mesh.get_group()
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        return cls(_host_group(group, ranks), ranks[0], dist.get_rank() == ranks[0])

    @property
    def shared(self) -> bool:
        return self.group is not None

    def decided(self, value: T | None) -> T:
        """The deciding rank's `value` on every rank (any picklable object; the others pass None)."""
        if not self.shared:
            return value
        box = [value if self.deciding else None]
        dist.broadcast_object_list(box, src=self.source, group=self.group)
        return box[0]

    def tree(self, drafted: TokenTree | None, device: torch.device) -> TokenTree:
        """The deciding rank's drafted tree on every rank: its node count, then its parents and tokens (two small
        broadcasts). The deciding rank reads its tree once (`TokenTree.host`, which the step reuses); the others
        get a tree on `device` with that host copy and no draft probabilities (they never verify)."""
        if not self.shared:
            return drafted
        if self.deciding:
            host = drafted.host(tokens=True)
            count = torch.tensor([len(host.parents)])
            dist.broadcast(count, src=self.source, group=self.group)
            dist.broadcast(torch.tensor([host.parents, host.tokens]), src=self.source, group=self.group)
            return drafted
        count = torch.zeros(1, dtype=torch.long)
        dist.broadcast(count, src=self.source, group=self.group)
        rows = torch.zeros(2, int(count), dtype=torch.long)
        dist.broadcast(rows, src=self.source, group=self.group)
        parents, tokens = rows.tolist()
        return TokenTree(tokens=rows[1].to(device), parents=rows[0].to(device),
                         _host=HostTree(parents=parents, tokens=tokens))

    def verdict(self, verdict: Verdict | None, tree: TokenTree) -> Verdict:
        """The deciding rank's verdict on `tree` on every rank: one broadcast of a buffer the tree's depth bounds
        (path length, ranks length, bonus token, then the path and the accepted ranks, padded)."""
        if not self.shared:
            return verdict
        longest = tree.max_depth + 1
        buffer = torch.zeros(3 + 2 * longest, dtype=torch.long)
        if self.deciding:
            path, ranks = list(verdict.path), list(verdict.accepted_ranks)
            buffer[:3] = torch.tensor([len(path), len(ranks), int(verdict.bonus_token)])
            buffer[3: 3 + len(path)] = torch.tensor(path, dtype=torch.long)
            buffer[3 + longest: 3 + longest + len(ranks)] = torch.tensor(ranks, dtype=torch.long)
        dist.broadcast(buffer, src=self.source, group=self.group)
        if self.deciding:
            return verdict
        values = buffer.tolist()
        steps, accepted, bonus = values[:3]
        return Verdict(path=values[3: 3 + steps], bonus_token=bonus,
                       accepted_ranks=values[3 + longest: 3 + longest + accepted])


ONE_PROCESS = Ranks()
