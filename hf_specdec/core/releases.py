"""What differs between the Transformers releases hf_specdec supports, in one place.

Nothing else in the package asks which release it runs on: it imports the names below.

- 5.24 renamed the cache argument `past_key_values` to `cache` in `generate`, `prepare_inputs_for_generation`,
  every model's `forward` and the output classes (the old name still works there, with a FutureWarning, until
  5.40 / 6.0). The package passes and reads the cache under `CACHE`, the running release's name, and takes a
  caller's cache under either name (`given_cache`).
- 5.24: Transformers' own assisted generation runs on static caches and compiles its verify pass
  (`ASSISTED_ON_STATIC_CACHE`); 5.25: it runs on models with recurrent state (`ASSISTED_ON_RECURRENT_STATE`), and its
  loop reads `num_drafting_tokens` from its candidate generator; `from_pretrained` kernelizes by default
  (`HUB_KERNELS_BY_DEFAULT`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers.cache_utils import LinearAttentionCacheLayerMixin

#: the releases this package runs on (kept equal to pyproject.toml's `transformers` requirement)
RANGE = ">=5.23,<6"
SUPPORTED = SpecifierSet(RANGE)
RELEASE = Version(transformers.__version__)

if Version(RELEASE.base_version) not in SUPPORTED:  # a 5.26.0.dev0 counts as 5.26.0
    raise ImportError(
        f"hf_specdec supports Transformers {RANGE} and Transformers {RELEASE} is installed: "
        f"pip install 'transformers{RANGE}'."
    )

RENAMED = Version(RELEASE.base_version) >= Version("5.24")
#: the name models, `generate` and output classes of this release give the cache
CACHE = "cache" if RENAMED else "past_key_values"
#: the names a caller may pass a cache under (either works on every supported release)
CACHE_NAMES = ("cache", "past_key_values")
#: Transformers' own assisted generation runs on a static cache, its verify pass compiled where plain's would be
ASSISTED_ON_STATIC_CACHE = RENAMED
#: Transformers' own assisted generation runs on models with recurrent state (Mamba, linear attention, ...)
ASSISTED_ON_RECURRENT_STATE = Version(RELEASE.base_version) >= Version("5.25")
#: `from_pretrained` kernelizes models with the Hub's kernels unless `USE_HUB_KERNELS` is off (`model.use_kernels`)
HUB_KERNELS_BY_DEFAULT = ASSISTED_ON_RECURRENT_STATE


def cache_arg(cache: Any) -> dict[str, Any]:
    """`cache` as the keyword argument this release's model forwards and `generate` take."""
    return {CACHE: cache}


def output_cache(output: Any) -> Any:
    """The cache a model or `generate` output carries (None if none), read without the deprecated property."""
    return getattr(output, CACHE, None)


def given_cache(kwargs: Mapping[str, Any]) -> Any:
    """The cache in `kwargs` under either name (None if none)."""
    return next((kwargs[name] for name in CACHE_NAMES if kwargs.get(name) is not None), None)


def with_cache_name(kwargs: dict[str, Any], stacklevel: int = 3) -> dict[str, Any]:
    """A caller's `generate` kwargs with their cache under `CACHE`: `past_key_values=` on 5.24+ warns as
    Transformers' own `generate` does (the warning points at the caller's line, `stacklevel` frames up), and `cache=`
    on 5.23 is taken as `past_key_values`. Both names at once are refused: one of them would be dropped."""
    given = [name for name in CACHE_NAMES if name in kwargs]
    if len(given) == 2:
        raise ValueError(
            "Both `cache` and `past_key_values` were passed: pass the cache once, as "
            f"`{CACHE}=` (Transformers {RELEASE})."
        )
    if not given or given[0] == CACHE:
        return kwargs
    if given[0] == "past_key_values":
        warnings.warn(
            f"`past_key_values` is deprecated for `generate` since Transformers 5.24 (installed: {RELEASE}); pass "
            "the cache as `cache=`.", FutureWarning, stacklevel=stacklevel,
        )
    kwargs = dict(kwargs)
    kwargs[CACHE] = kwargs.pop(given[0])
    return kwargs


def keeps_recurrent_state(model: Any, layers: list[Any]) -> bool:
    """Whether `model` (its cache built from its config: `layers`) keeps a recurrent state: 5.23 and 5.24 flag such
    models `_is_stateful`; 5.25 dropped the flag, and every release builds their caches of linear-attention layers."""
    return getattr(model, "_is_stateful", False) or any(isinstance(layer, LinearAttentionCacheLayerMixin)
                                                        for layer in layers)
