"""Transformers' own output type, plus the speculation stats; and what `return_dict_in_generate` keeps per token."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import ModelOutput

from ..runtime.attention import SLIDING, AttentionLayout
from .stats import SpeculationStats


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` with `speculation_stats`: what the speculation did in this call."""

    speculation_stats: SpeculationStats | None = None


@dataclass
class TokenRecords:
    """Per generated token, what plain `generate` returns with `return_dict_in_generate`: the scores and logits of
    the position that chose it, and the hidden states and attentions of the pass that computed that position.

    Plain `generate`'s first entry covers the prompt's pass; every later one a pass over one token. A tree node's
    row is that one-token pass: its hidden states are the causal values of its path, and its attention row, over
    the past and its own ancestors (every other key is masked, weight zero), is the causal row of that path.
    """

    want_scores: bool = False
    want_logits: bool = False
    want_hidden_states: bool = False
    want_attentions: bool = False
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    hidden_states: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    attentions: list[tuple[torch.Tensor, ...]] = field(default_factory=list)

    @classmethod
    def asked_by(cls, config: GenerationConfig) -> TokenRecords:
        keep = bool(config.return_dict_in_generate)
        return cls(*(keep and bool(getattr(config, name)) for name in (
            "output_scores", "output_logits", "output_hidden_states", "output_attentions")))

    @property
    def wants_any(self) -> bool:
        return self.want_scores or self.want_logits or self.wants_pass_outputs

    @property
    def wants_pass_outputs(self) -> bool:
        """Whether model passes must return hidden states / attentions."""
        return self.want_hidden_states or self.want_attentions

    def add(
        self,
        scores: torch.Tensor,
        logits: torch.Tensor,
        output: ModelOutput | None,
        node: int | None = None,
        past: int = 0,
        path: list[int] | None = None,
        layout: AttentionLayout | None = None,
    ) -> None:
        """One generated token: `scores`/`logits` `(vocab,)` of its position; `output` the pass that computed it,
        whole (the prompt's pass, `node` None) or its row `node` (a tree pass after `past` cached tokens, `path` the
        root-to-node path) over the keys that row attends to, of which a sliding-window layer of `layout` returns
        the last window, as plain's windowed cache holds them."""
        if self.want_scores:
            self.scores.append(scores[None])
        if self.want_logits:
            self.logits.append(logits[None].float())
        if self.want_hidden_states:
            self.hidden_states.append(tuple(
                h if node is None else h[:, node : node + 1].clone() for h in output.hidden_states
            ))
        if self.want_attentions:
            keys = None if node is None else torch.cat([torch.arange(past), past + torch.tensor(path)])
            self.attentions.append(tuple(
                a if node is None else a[:, :, node : node + 1, layer_keys(keys, layout, i).to(a.device)].clone()
                for i, a in enumerate(output.attentions)
            ))

    def fields(self) -> dict[str, tuple | None]:
        """The output fields, None where not asked (as plain `generate` leaves them)."""
        return {
            "scores": tuple(self.scores) if self.want_scores else None,
            "logits": tuple(self.logits) if self.want_logits else None,
            "hidden_states": tuple(self.hidden_states) if self.want_hidden_states else None,
            "attentions": tuple(self.attentions) if self.want_attentions else None,
        }


def layer_keys(keys: torch.Tensor, layout: AttentionLayout | None, layer: int) -> torch.Tensor:
    """The key columns plain `generate`'s attention row holds in `layer`: a sliding-window layer's cache keeps only
    the last window of them."""
    if layout is None or layout.layer_types[layer] != SLIDING:
        return keys
    return keys[-layout.window :]
