"""One folder per speculation method, in the manner of peft's tuners: each holds its config (a registered
dataclass with help text) and, where the method has one of its own, its drafter. Importing this package registers
every method by name (`speculation="<name>"`).

Shared machinery lives below, in `drafting/`: the draft-model runner, the static-shape drafter (chain, tree,
sequoia), the best-first engine (specexec, staged), prompt lookup (prompt_lookup, staged) and child selection.
"""

from .chain import ChainConfig
from .prompt_lookup import NGramConfig, PromptLookupConfig
from .sequoia import SequoiaConfig
from .specexec import SpecExecConfig
from .staged import MergedDrafter, NGramModel, NGramModelDrafter, StagedConfig
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
    "TreeConfig",
]
