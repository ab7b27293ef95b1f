"""One folder per speculation method, in the manner of peft's tuners: each holds its config (a registered
dataclass with help text) and, where the method has one of its own, its drafter. Importing this package registers
every method by name (`speculation="<name>"`).

The config bases two or more methods derive from sit beside the folders: `static_shape.py` (`StaticShapeConfig`:
chain, tree, sequoia) and `step_sized.py` (`StepSizedConfig`: specexec, staged). Shared machinery lives below, in
`draft/` (the draft-model runner, the static-shape drafter, the best-first engine, prompt lookup) and `plan/` (tree
shapes, sizes and plans).
"""

from .chain import ChainConfig
from .prompt_lookup import NGramConfig, PromptLookupConfig
from .sequoia import SequoiaConfig
from .specexec import SpecExecConfig
from .staged import MergedDrafter, NGramModel, NGramModelDrafter, StagedConfig
from .static_shape import StaticShapeConfig
from .step_sized import StepSizedConfig
from .tree import TreeConfig

__all__ = [
    "ChainConfig",
    "MergedDrafter",
    "NGramConfig",
    "NGramModel",
    "NGramModelDrafter",
    "PromptLookupConfig",
    "SequoiaConfig",
    "SpecExecConfig",
    "StagedConfig",
    "StaticShapeConfig",
    "StepSizedConfig",
    "TreeConfig",
]
