"""Where hf_specdec keeps files of its own: one cache folder (plans, latency profiles, the embedded models)."""

from __future__ import annotations

import json
import os
import threading
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


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write `data` as JSON atomically: a reader never sees half a file, and a failed write leaves neither half a
    file nor a stray temporary one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
