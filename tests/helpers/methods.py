"""The methods at fixed shapes (every step drafts the same tree): what tests that count reads or passes run."""

from __future__ import annotations

from hf_specdec import ChainConfig, SequoiaConfig, SpecExecConfig, StagedConfig, TreeConfig
from hf_specdec.methods.sequoia.dp import plan_tree

GREEDY = {
    "chain": ChainConfig(num_draft_tokens=4, confidence_threshold=0.4),  # Transformers' stop, not sized
    "tree": TreeConfig(widths=[3, 2]),
    "sequoia": SequoiaConfig(plan=plan_tree([0.6, 0.2, 0.1, 0.05], 32, 6)),
    "specexec": SpecExecConfig(budget=32, max_depth=6, width=4),
    "staged": StagedConfig(budget=32, max_depth=6),  # n-gram guesses confirmed in the draft's passes
}
