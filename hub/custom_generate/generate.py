"""hf_specdec as a Hub `custom_generate` repo: `generate(..., custom_generate=<this repo>, trust_remote_code=True)`.

Transformers loads this file and calls `generate(model=..., **generate's arguments)`, so users get tree
speculation without importing hf_specdec. Importing hf_specdec here also installs its `speculation=` option on
every model for the rest of the process (the same as `import hf_specdec`).

Which method runs: the call's `speculation=` (with `speculation_config=`), else the model's
`generation_config.speculation`, else "tree" (a static tree grown by `assistant_model`, which must be given).
"""

from __future__ import annotations

from typing import Any

import hf_specdec  # noqa: F401  (registers the methods and installs `speculation=`)
from hf_specdec.integration.generate import generate as generate_with_speculation
from hf_specdec.integration.generation_config import get_speculation

DEFAULT_SPECULATION = "tree"


def generate(*args: Any, model: Any, **kwargs: Any) -> Any:
    """`model.generate(*args, **kwargs)` with hf_specdec's speculation (default "tree")."""
    if kwargs.get("speculation") is None:
        generation_config = kwargs.get("generation_config") or model.generation_config
        if get_speculation(generation_config) is None:  # also validates a value read from generation_config.json
            kwargs["speculation"] = DEFAULT_SPECULATION
    return generate_with_speculation(model, *args, **kwargs)
