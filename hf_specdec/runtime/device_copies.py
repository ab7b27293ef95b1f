"""A tree pass's mask and positions put once on each device a target's layers run on (accelerate `device_map` over
several GPUs), instead of once per layer.

accelerate's `AlignDevicesHook` moves every input of a hooked layer to that layer's execution device before it runs
(`send_to_device` in its `pre_forward`): the 4-D tree mask and the position tensors, built on the first device, cross
to another GPU again for every layer of every pass. torch's forward pre-hooks run before accelerate's wrapped
`forward`, so a pre-hook on each layer placed elsewhere swaps in a copy made once per pass and device; accelerate
then finds it already there (`.to` of a tensor on its device is itself). The hooks live for one pass only, and a
target on one device gets none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: the inputs every layer of a pass shares (the hidden states move from layer to layer, as accelerate moves them)
SHARED_INPUTS = ("attention_mask", "position_ids", "position_embeddings", "cache_position")


def layer_devices(model: torch.nn.Module) -> dict[torch.nn.Module, torch.device]:
    """Modules accelerate runs on a device other than the model's first one, with that device."""
    places = {}
    for module in model.modules():
        device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if device is not None:
            places[module] = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    first = next(iter(places.values()), None)
    return {module: device for module, device in places.items() if device != first}


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device, non_blocking=True)


class DeviceCopies:
    """Per-pass copies of the shared inputs on each device of `layers` (module -> device)."""

    def __init__(self, layers: dict[torch.nn.Module, torch.device]) -> None:
        self.layers = layers
        self.copies: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # (id, device) -> (source, copy)

    @classmethod
    def of(cls, model: torch.nn.Module) -> DeviceCopies | None:
        """None for a model on one device: nothing to hook."""
        layers = layer_devices(model)
        return cls(layers) if layers else None

    def _placed(self, value, device: torch.device):
        if isinstance(value, torch.Tensor):
            key = (id(value), str(device))
            if key not in self.copies:  # the source is kept too: its id cannot be reused within the pass
                self.copies[key] = (value, copy_to(value, device))
            return self.copies[key][1]
        if isinstance(value, (tuple, list)):
            return type(value)(self._placed(item, device) for item in value)
        if isinstance(value, dict):
            return {name: self._placed(item, device) for name, item in value.items()}
        return value

    @contextlib.contextmanager
    def one_pass(self) -> Iterator[None]:
        """Hooks that place the shared inputs on each layer's device, made once per device, for one pass."""

        def hook(device: torch.device):
            def swap(module, args, kwargs):
                return args, {name: self._placed(value, device) if name in SHARED_INPUTS else value
                              for name, value in kwargs.items()}
            return swap

        handles = [module.register_forward_pre_hook(hook(device), with_kwargs=True)
                   for module, device in self.layers.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.copies.clear()


def one_pass(copies: DeviceCopies | None) -> contextlib.AbstractContextManager:
    """`copies.one_pass()`, or nothing for a model on one device."""
    return copies.one_pass() if copies is not None else contextlib.nullcontext()
