"""The inputs a call gives the model besides its token ids, and how each reaches the loop's passes: an allow-list.

Plain `generate` feeds the model what its `prepare_inputs_for_generation` builds from the call's inputs: everything
at the prompt's pass (images, audio features, token types), and at each later pass only what that function keeps.
The loop's prefill is plain's own first pass. A tree pass is a later pass over several tokens at once, so every
input a later pass keeps must be placed per token: the token-type inputs that `generate` extends for new tokens
(`_update_model_kwargs_for_generation`) are, by position. Any other input a later pass would keep is refused by
name before anything runs, never dropped.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from .releases import CACHE_NAMES

#: what the loop itself gives every pass (ids, tree mask, positions, cache) or reads as a setting
LOOP_INPUTS = frozenset({
    "input_ids", "attention_mask", "position_ids", *CACHE_NAMES, "use_cache", "logits_to_keep",
    "cache_position", "return_dict", "output_attentions", "output_hidden_states",
})
#: per-token inputs a later pass keeps, and the value `generate` gives each new token: the prompt's last, or zero
GROWING = {"token_type_ids": "last", "mm_token_type_ids": "zero"}


def explicit_parameters(model: PreTrainedModel) -> frozenset[str]:
    """The arguments `model.forward` names; `**kwargs` never counts as taking an argument."""
    parameters = inspect.signature(model.forward).parameters.values()
    return frozenset(p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def decoding_inputs(model: PreTrainedModel, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The inputs beyond the loop's own that `model` takes at every pass after the prompt's, read from its own
    `prepare_inputs_for_generation` (a model may keep an input there or drop it after the prompt)."""
    skip = ("input_ids", "inputs", "inputs_embeds", *CACHE_NAMES)
    kwargs = {k: v for k, v in model_kwargs.items() if k not in skip and v is not None}
    kwargs.setdefault("use_cache", True)
    prepared = model.prepare_inputs_for_generation(
        input_ids, next_sequence_length=1, is_first_iteration=False, **kwargs
    )
    return {k: v for k, v in prepared.items() if k not in LOOP_INPUTS and v is not None}


def unplaceable_inputs(model: PreTrainedModel, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> list[str]:
    """Names of inputs a later pass of `model` would take that a tree pass cannot place per node."""
    return sorted(name for name in decoding_inputs(model, input_ids, model_kwargs) if name not in GROWING)


@dataclass(frozen=True)
class TokenInputs:
    """Per-token inputs of the call (token types), placed at any position: a prompt token keeps its own value,
    a new token gets what `generate` would give it. Empty for most models."""

    prompt: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (1, prompt length)

    @classmethod
    def of(cls, model: PreTrainedModel, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> TokenInputs:
        """What later passes of `model` take (call `unplaceable_inputs` first: anything else is refused there)."""
        later = decoding_inputs(model, input_ids, model_kwargs)
        return cls({name: model_kwargs[name] for name in GROWING if name in later})

    def for_model(self, model: PreTrainedModel) -> TokenInputs:
        """The inputs another model (a draft) names in its forward: it proposes only, so it may go without."""
        names = explicit_parameters(model)
        return TokenInputs({k: v for k, v in self.prompt.items() if k in names})

    def at(self, positions: torch.Tensor, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Each input's values `(1, n)` for tokens at `positions` `(n,)`."""
        out = {}
        for name, values in self.prompt.items():
            row = values[0].to(positions.device)
            new = row[-1] if GROWING[name] == "last" else torch.zeros((), dtype=row.dtype, device=row.device)
            inside = positions < row.shape[0]
            placed = torch.where(inside, row[positions.clamp(max=row.shape[0] - 1)], new)
            out[name] = placed[None].to(device or positions.device)
        return out
