"""Where hf_specdec keeps files of its own: one cache folder (plans, latency profiles, the embedded models)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import platformdirs

CACHE_ENV = "HF_SPECDEC_CACHE"


def cache_dir() -> Path:
    """Root of the cache: `$HF_SPECDEC_CACHE`, else the user cache dir (`~/.cache/hf_specdec` on Linux)."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("hf_specdec", appauthor=False))


def json_object(value: Any, what: str) -> dict:
    """`value` if it is a JSON object: files in the cache folder are read defensively (a user may drop anything
    there), so a list or a string where an object belongs is a clear TypeError, never an AttributeError later."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be a JSON object, got {type(value).__name__} {str(value)[:40]!r}")
    return value


def json_list(value: Any, what: str) -> list:
    """`value` if it is a JSON array (see `json_object`)."""
    if not isinstance(value, list):
        raise TypeError(f"{what} must be a JSON array, got {type(value).__name__} {str(value)[:40]!r}")
    return value
