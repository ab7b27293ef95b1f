"""hf_specdec: tree-structured speculative decoding for Hugging Face Transformers.

`import hf_specdec` adds one option to `generate`:

    model.generate(input_ids, assistant_model=draft, speculation="tree", max_new_tokens=128)

The folders, in the order data flows: `integration` (how `speculation=` reaches the loop) → `decoding` (the loop
that wires the stages) → `methods` (one folder per method, as peft's tuners) → the stages `plan` (tree shapes, sizes
and plans for a pair) → `draft` (shared drafting machinery) → `verify` (verifiers) → `accept` (emitting the block,
compacting the caches) → `core` (contracts). Imports only point down the layers integration → decoding → methods →
draft | kernels → plan → verify | accept → core (`make lint` checks it; a drafter sizes its tree with plan's cost
models, so `draft` stands on `plan`). `hf_specdec_tools` (the `hf-specdec` command, benchmarks, the demo, the
embedded models) sits apart: the library never imports it.
"""

from .core import (
    SPECULATION_METHODS,
    Drafter,
    SpeculationConfig,
    TokenTree,
    Verdict,
    Verifier,
    register_speculation,
)
from .core.version import __version__
from .decoding import SpeculationStats, SpeculativeDecoderOnlyOutput
from .draft import ModelTreeDrafter
from .integration import install, uninstall
from .integration.generation_config import set_speculation
from .kernels import frequent_tokens, prepack, quantize_draft, restrict_vocabulary, unpack
from .methods import (
    ChainConfig,
    NGramConfig,
    NGramModel,
    NGramModelDrafter,
    PromptLookupConfig,
    SequoiaConfig,
    SpecExecConfig,
    StagedConfig,
    TreeConfig,
)
from .methods.prompt_lookup import NGramDrafter, PromptLookupDrafter
from .methods.sequoia import SequoiaPlan, TreePlan, calibrate, plan_tree
from .methods.specexec import BestFirstDrafter
from .verify import VERIFIERS, register_verifier

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
    "NGramModel",
    "NGramModelDrafter",
    "PromptLookupConfig",
    "PromptLookupDrafter",
    "SequoiaConfig",
    "SequoiaPlan",
    "SpeculationConfig",
    "SpecExecConfig",
    "SpeculationStats",
    "StagedConfig",
    "SpeculativeDecoderOnlyOutput",
    "TokenTree",
    "TreeConfig",
    "Verifier",
    "TreePlan",
    "Verdict",
    "__version__",
    "calibrate",
    "frequent_tokens",
    "install",
    "plan_tree",
    "prepack",
    "quantize_draft",
    "register_speculation",
    "register_verifier",
    "restrict_vocabulary",
    "set_speculation",
    "uninstall",
    "unpack",
]
