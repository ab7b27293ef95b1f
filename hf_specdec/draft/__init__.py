"""Drafting machinery the methods share: the draft-model runner (`draft_model.py`; its masked passes run through
`kernels/lean_pass.py` for Llama-shaped drafts), the static-shape drafter (`shaped_tree.py`: chain, tree, sequoia), a
chain cut where the draft is unsure (`confident_chain.py`), a shape sized every step (`sized_shape.py`: tree,
sequoia), the draft behind the measured guard (`guarded.py`), a fixed shape drafted for every row of a batch
(`batch_shaped.py`, sized every step for the batch in `batch_sized.py`), and a batch's rows drafted one by one, each
with its method's drafter (`row_drafters.py`). A method's own drafter lives in its folder
(`methods/specexec/best_first.py`, `methods/prompt_lookup/drafter.py`); the low-bit draft and its output layer over a
subset of the vocabulary are kernels (`kernels/`)."""

from .draft_model import DraftModelRunner
from .shaped_tree import ModelTreeDrafter

__all__ = ["DraftModelRunner", "ModelTreeDrafter"]
