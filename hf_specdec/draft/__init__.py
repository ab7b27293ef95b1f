"""Drafting machinery the methods share: the draft-model runner (`draft_model.py`; its masked passes run through
`kernels/lean_pass.py` for Llama-shaped drafts), the static-shape drafter (`shaped_tree.py`: chain, tree, sequoia), a
chain cut where the draft is unsure (`confident_chain.py`), a shape sized every step (`sized_shape.py`: tree,
sequoia), the best-first engine (`best_first.py`: specexec, staged), prompt lookup (`prompt_lookup.py`:
prompt_lookup, the cheapest staged stage), the draft behind the measured guard (`guarded.py`), and a fixed shape
drafted for every row of a batch (`batch_shaped.py`, sized every step for the batch in `batch_sized.py`). The
low-bit draft and its output layer over a subset of the vocabulary are kernels (`kernels/`)."""

from .best_first import BestFirstDrafter
from .draft_model import DraftModelRunner
from .prompt_lookup import NGramDrafter, PromptLookupDrafter
from .shaped_tree import ModelTreeDrafter

__all__ = ["BestFirstDrafter", "DraftModelRunner", "ModelTreeDrafter", "NGramDrafter", "PromptLookupDrafter"]
