"""One folder per speculation method, in the manner of peft's tuners: each holds its config (a registered
dataclass with help text) and its own algorithm: Sequoia's DP, calibration and plan files (`sequoia/`), SpecExec's
best-first growth (`specexec/`), the prompt-lookup drafter and its sizing (`prompt_lookup/`), the stage stack
(`staged/`, which stacks prompt lookup under SpecExec's growth). Importing this package registers every method by
name (`speculation="<name>"`).

The config bases two or more methods derive from sit beside the folders: `static_shape.py` (`StaticShapeConfig`:
chain, tree, sequoia) and `step_sized.py` (`StepSizedConfig`: specexec, staged). What several methods share lives
below, in `draft/` (the draft-model runner, the static-shape drafter `chain`, `tree` and `sequoia` draft with) and
`plan/` (tree shapes, latency curves, per-step cost models, the guard).
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
