"""`speculation` as a `GenerationConfig` field, so a saved model speculates by default once given a draft.

The field holds JSON: a method name (`"tree"`) or a dict of one method's settings
(`{"method": "tree", "widths": [3, 2]}`). It round-trips through `generation_config.json` (saving writes every
attribute), but nothing of Transformers reads it, so a bad value would only surface at `generate` time: these
helpers validate it when it is set and, at `generate` time, name the file's field and the fix in the error.

Loading drops unknown fields of a file that says `"_from_model_config": true` (what a model's default generation
config saves as), so `model.generation_config.speculation = "tree"` alone would not survive a reload:
`keep_field_on_load` makes `GenerationConfig.from_dict` keep this one field (installed with `speculation=`).
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig

from ..core.config import SpeculationConfig, known_methods, make_config, settings

FIELD = "speculation"


def speculation_to_json(config: SpeculationConfig) -> str | dict[str, Any]:
    """The compact JSON form of a config: its method name, plus only the settings that differ from the defaults."""
    defaults = type(config)()
    changed = {
        f.name: getattr(config, f.name)
        for f in settings(config)
        if getattr(config, f.name) != getattr(defaults, f.name)
    }
    return {"method": config.method, **changed} if changed else config.method


def set_speculation(
    generation_config: GenerationConfig, method_or_config: str | dict | SpeculationConfig, **settings: Any
) -> SpeculationConfig:
    """Validate, then store `speculation` in `generation_config`; returns the resolved config.

    `set_speculation(model.generation_config, "tree", widths=[3, 2])` then `model.save_pretrained(path)`:
    the reloaded model speculates whenever `generate` gets an `assistant_model`.
    """
    config = make_config(method_or_config, settings)
    setattr(generation_config, FIELD, speculation_to_json(config))
    # A generation config derived from the model config drops unknown fields when reloaded (Transformers'
    # `_from_model_config` rule): mark it as a real generation config so the field survives save/load.
    generation_config._from_model_config = False
    return config


def clear_speculation(generation_config: GenerationConfig) -> None:
    """Remove the field: the model generates plainly again unless a call passes `speculation=`."""
    if hasattr(generation_config, FIELD):
        delattr(generation_config, FIELD)


def get_speculation(generation_config: GenerationConfig | None) -> SpeculationConfig | None:
    """The validated config stored in `generation_config`, or None; a bad value raises naming the field and fix."""
    value = getattr(generation_config, FIELD, None)
    if value is None:
        return None
    try:
        return make_config(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"generation_config.json: the `{FIELD}` field holds {value!r}, which hf_specdec cannot use: {exc} "
            f"Fix: set `{FIELD}` to a method name ({known_methods()}) or a dict such as "
            '{"method": "tree", "widths": [4, 2]} (hf_specdec.integration.generation_config.set_speculation checks '
            "it before you save_pretrained), or delete the field to generate without speculation."
        ) from exc


_ORIGINAL_FROM_DICT = GenerationConfig.__dict__["from_dict"]  # the classmethod itself, put back as it was


def _from_dict_keeping_speculation(cls, config_dict: dict[str, Any], **kwargs: Any):
    """`GenerationConfig.from_dict`, then the `speculation` field of `config_dict` where Transformers dropped it."""
    result = _ORIGINAL_FROM_DICT.__func__(cls, config_dict, **kwargs)
    config = result[0] if isinstance(result, tuple) else result  # (config, unused kwargs) when asked for
    if config_dict.get(FIELD) is not None and getattr(config, FIELD, None) is None:
        setattr(config, FIELD, config_dict[FIELD])
    return result


def keep_field_on_load(keep: bool) -> None:
    """Make loaded generation configs keep `speculation` whatever `_from_model_config` says (False: undo it)."""
    GenerationConfig.from_dict = classmethod(_from_dict_keeping_speculation) if keep else _ORIGINAL_FROM_DICT
