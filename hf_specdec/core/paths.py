"""Where hf_specdec keeps files of its own: one cache folder (plans, latency profiles, the embedded models)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

CACHE_ENV = "HF_SPECDEC_CACHE"


def cache_dir() -> Path:
    """Root of the cache: `$HF_SPECDEC_CACHE`, else the user cache dir (`~/.cache/hf_specdec` on Linux)."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("hf_specdec", appauthor=False))
