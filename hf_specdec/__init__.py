"""hf_specdec: tree-structured speculative decoding for Hugging Face Transformers.

`import hf_specdec` adds one option to `generate`:

    model.generate(input_ids, assistant_model=draft, speculation="tree", max_new_tokens=128)
"""

from .calibration import SequoiaPlan, calibrate
from .config import SPECULATION_METHODS, SpeculationConfig, register_speculation
from .decoding import SpeculationStats, SpeculativeDecoderOnlyOutput
from .drafting import Drafter, ModelTreeDrafter
from .drafting.best_first import BestFirstDrafter, SpecExecConfig
from .drafting.methods import ChainConfig, SequoiaConfig, TreeConfig
from .drafting.ngram import NGramConfig, NGramDrafter
from .drafting.quantize import quantize_draft
from .drafting.staged import ModelStageDrafter, NGramModel, NGramModelDrafter, StagedConfig
from .integration import install, uninstall
from .integration.generation_config import set_speculation
from .planning import TreePlan, plan_tree
from .tree import TokenTree
from .verification import VERIFIERS, Verdict, register_verifier

__version__ = "0.1.0"

install()

__all__ = [
    "SPECULATION_METHODS",
    "VERIFIERS",
    "BestFirstDrafter",
    "ChainConfig",
    "Drafter",
    "ModelStageDrafter",
    "ModelTreeDrafter",
    "NGramConfig",
    "NGramDrafter",
    "NGramModel",
    "NGramModelDrafter",
    "SequoiaConfig",
    "SequoiaPlan",
    "SpeculationConfig",
    "SpecExecConfig",
    "SpeculationStats",
    "StagedConfig",
    "SpeculativeDecoderOnlyOutput",
    "TokenTree",
    "TreeConfig",
    "TreePlan",
    "Verdict",
    "calibrate",
    "install",
    "plan_tree",
    "quantize_draft",
    "register_speculation",
    "register_verifier",
    "set_speculation",
    "uninstall",
]
