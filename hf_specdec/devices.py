"""Where a model computes, and whether accelerate keeps its weights elsewhere.

`model.device` is the device of the first parameter: for a model offloaded with accelerate that is often
`meta` (the weights live on disk), which is no place to build inputs. The execution device of accelerate's hook
is where the forward pass really runs.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def execution_device(model: PreTrainedModel) -> torch.device:
    """The device the model's forward pass runs on: accelerate's execution device, else `model.device`."""
    hook_device = getattr(getattr(model, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(hook_device)  # an int is an accelerator ordinal (GPU machines only)
    device_map = getattr(model, "hf_device_map", None) or {}
    for place in device_map.values():  # the first module kept on a compute device
        if str(place) not in ("disk", "meta"):
            return torch.device(place)
    return model.device if model.device.type != "meta" else torch.device("cpu")


def is_offloaded(model: PreTrainedModel) -> bool:
    """True when accelerate keeps some of the model's weights off its compute device (CPU RAM or disk).

    Such a model pays its weight transfer on every pass, whatever the number of tokens: its curve is flat.
    """
    device_map = getattr(model, "hf_device_map", None) or {}
    places = {str(place) for place in device_map.values()}
    return "disk" in places or ("cpu" in places and execution_device(model).type != "cpu")
