"""What a pass's logits become: Transformers' processors applied per tree node (`processing.py`), top-k/top-p in linear
time (`narrowed.py`), argmax and top-k over vocabulary-wide rows (`wide_rows.py`), and a drafter's children picked
from a row (`child_selection.py`). Below the stages, above the contracts."""
