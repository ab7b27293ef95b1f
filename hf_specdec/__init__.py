"""hf_specdec: tree-structured speculative decoding for Hugging Face Transformers.

`import hf_specdec` adds one option to `generate`:

    model.generate(input_ids, assistant_model=draft, speculation="tree", max_new_tokens=128)
"""

from .config import SPECULATION_METHODS, SpeculationConfig, register_speculation
from .decoding import SpeculationStats, SpeculativeDecoderOnlyOutput
from .drafting import Drafter, ModelTreeDrafter
from .drafting.best_first import BestFirstDrafter, SpecExecConfig
from .drafting.methods import ChainConfig, TreeConfig
from .drafting.ngram import NGramConfig, NGramDrafter
from .integration import install, uninstall
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
    "ModelTreeDrafter",
    "NGramConfig",
    "NGramDrafter",
    "SpeculationConfig",
    "SpecExecConfig",
    "SpeculationStats",
    "SpeculativeDecoderOnlyOutput",
    "TokenTree",
    "TreeConfig",
    "Verdict",
    "install",
    "register_speculation",
    "register_verifier",
    "uninstall",
]
