"""`speculation="tree"`: a static tree shape of your choice, drafted level by level."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...core.config import register_speculation
from ...drafting.shaped_tree import StaticShapeConfig
from ...planning.shapes import validate_parents, widths_parents

# Wide and shallow: on a 2-core CPU a 32-node target pass costs < 2 single-token passes, while each
# extra level costs a whole draft pass (README, "What this hardware rewards").
DEFAULT_TREE_WIDTHS = [4, 2, 1, 1]


@register_speculation
@dataclass
class TreeConfig(StaticShapeConfig):
    """A static tree: give `widths` (children of every node, per level) or an explicit `parents` list."""

    method = "tree"
    widths: list[int] | None = field(
        default=None,
        metadata={"help": f"Children of every node at each level, e.g. [4, 2, 1]. Default {DEFAULT_TREE_WIDTHS}."},
    )
    parents: list[int] | None = field(
        default=None,
        metadata={"help": "Explicit shape: parents[i] is node i's parent, -1 for the root, breadth-first order."},
    )

    def validate(self) -> None:
        if self.widths is not None and self.parents is not None:
            raise ValueError("Give a tree either `widths` or `parents`, not both.")
        if self.widths is not None and (not self.widths or any(int(w) < 1 for w in self.widths)):
            raise ValueError(f"Tree widths must be positive integers, one per level, got {self.widths!r}.")
        if self.parents is not None:
            validate_parents(list(self.parents))

    def shape(self) -> list[int]:
        if self.parents is not None:
            return list(self.parents)
        return widths_parents(list(self.widths or DEFAULT_TREE_WIDTHS))
