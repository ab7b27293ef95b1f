"""A masked pass without Transformers' model wrapper, for models built of Llama-shaped decoder layers: every draft
pass, and off the CPU the target's tree passes.

Why: a draft runs several passes a step, each over a few rows, so what a pass costs besides its matmuls counts. On
a 2-core Zen 4 the 0.5B Qwen2 draft (int4/int8, "mixed") took 27.3 ms over one row through the model's forward and
25.5 ms through this one; 39.6 against 35.7 ms over four (`studies.lean_pass`): the wrapper's Python,
its mask and output bookkeeping, and an RMSNorm spelled in eight ops where `F.rms_norm` is one. On a GPU each op
saved is a kernel launch. A draft whose logits differ in their last bits only proposes differently, never wrongly.
Off the CPU the target's eager tree passes take it too (`decoding.step.lean_target`): there a 7B target's pass is bound
by its host time, and the lean pass cut it from 21.3 to 13.7 ms on an H200 (`benchmarks/results/gpu-h200/README.md`); on
a CPU, where its matmuls bound it, the target keeps its forward (1-4% faster lean on the 1.5B, and bfloat16 logits that
round differently from plain's).

The pass is the decoder of Llama, Qwen2 and Mistral: embed; per layer RMSNorm, q/k/v projections (one int4 call for
the three where the draft is int4, `fused_int4.py`; the same for gate/up), rotary positions (query and key heads in
one go), the cache's update, attention under the given additive mask (query heads packed per key/value head), the output
projection, RMSNorm and the gated MLP, each with its residual; the final norm and the output layer over the kept
rows. The modules are the model's own (a quantized draft's Linear replacements included; the rotary module computes
whatever scaling the config asks). Anything else (another family, accelerate's hooks, per-token inputs, a static
cache's padded passes) keeps the model's forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Cache, PreTrainedModel

from ..runtime.attention import Masks
from .fused_int4 import FusedInt4

#: model classes whose decoder layers this pass reproduces (norm, attention, MLP and residuals in the same order)
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class LeanPass:
    """`model`'s forward over `input_ids` `(b, n)` at `position_ids` `(b, n)` under an additive `(b, 1, n, keys)`
    mask (or a dict of them by layer type), writing keys and values into `cache`; logits of the last `keep` rows
    (all: 0)."""

    def __init__(self, model: PreTrainedModel, layer_types: tuple[str, ...]) -> None:
        self.model, self.layer_types = model, layer_types
        config = model.config
        self.hidden, self.eps = config.hidden_size, config.rms_norm_eps
        self.groups = config.num_attention_heads // config.num_key_value_heads  # query heads per key/value head
        # int4 drafts: each layer's query/key/value and gate/up as one call where their int4 copies run (or None)
        layers = model.model.layers
        self.qkv = [FusedInt4.of([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
                    for layer in layers]
        self.gate_up = [FusedInt4.of([layer.mlp.gate_proj, layer.mlp.up_proj]) for layer in layers]

    @classmethod
    def of(cls, model: PreTrainedModel, layer_types: tuple[str, ...]) -> LeanPass | None:
        """The lean pass of `model`, or None where it would not compute the model's own function."""
        if type(model).__name__ not in SUPPORTED or getattr(model.config, "pretraining_tp", 1) not in (None, 1):
            return None
        if any(hasattr(module, "_hf_hook") for module in model.modules()):  # accelerate places weights per call
            return None
        if "forward" in vars(model):  # a forward already replaced (by a wrapper of the user's): keep it
            return None
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None or len(layers) != len(layer_types):
            return None
        needed = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
        if not all(all(hasattr(layer, name) for name in needed) for layer in layers):
            return None
        return cls(model, layer_types)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Masks, cache: Cache,
                 keep: int = 0) -> torch.Tensor:
        """Run as the model's own call, its forward swapped for this pass, so that forward hooks (a profiler, a
        benchmark's pass clock, the user's) see one draft pass, as they would without the lean pass."""
        model = self.model
        model.forward = self._forward  # an instance attribute: shadows the class's forward for this call only
        try:
            return model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         cache=cache, logits_to_keep=keep)
        finally:
            del model.forward

    @torch.no_grad()
    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Masks,
                 cache: Cache, logits_to_keep: int = 0) -> torch.Tensor:
        body, n = self.model.model, input_ids.shape[1]
        x = body.embed_tokens(input_ids)
        cos, sin = body.rotary_emb(x, position_ids)
        half = sin.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # rotate_half's sign, once a pass (`_rotate`)
        cos, sin = cos[:, :, None], sin[:, :, None]  # (b, n, 1, head_dim): broadcast over heads, before transposing
        # each key/value head's query heads become one block of rows, so keys are never repeated: the mask per block
        masks = attention_mask if isinstance(attention_mask, dict) else dict.fromkeys(self.layer_types, attention_mask)
        packed = {kind: mask if n == 1 else mask.repeat(1, 1, self.groups, 1) for kind, mask in masks.items()}
        # whether this pass's rows run on the int4 copies (every layer's input is as wide): decided once per pass
        fuse = next((fused.takes(x) for fused in self.qkv + self.gate_up if fused is not None), False)
        for index, layer in enumerate(body.layers):
            h = self._norm(x, layer.input_layernorm)
            x = x + self._attention(layer.self_attn, h, cos, sin, packed[self.layer_types[index]],
                                    cache, index, fuse)
            h = self._norm(x, layer.post_attention_layernorm)
            mlp, fused = layer.mlp, self.gate_up[index]
            if fuse and fused is not None:
                gate, up = fused(h).split(fused.widths, dim=-1)
            else:
                gate, up = mlp.gate_proj(h), mlp.up_proj(h)
            x = x + mlp.down_proj(mlp.act_fn(gate) * up)
        x = self._norm(x[:, -logits_to_keep:] if logits_to_keep else x, body.norm)
        return self.model.lm_head(x)

    def _norm(self, x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden,), norm.weight, self.eps)

    def _attention(self, attention, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                   cache: Cache, index: int, fuse: bool) -> torch.Tensor:
        (b, n, _), head, fused = h.shape, attention.head_dim, self.qkv[index]
        if fuse and fused is not None:  # one call; its query and key columns side by side
            out = fused(h)
            qk, value = out.split([out.shape[-1] - fused.widths[2], fused.widths[2]], dim=-1)
        else:
            qk, value = torch.cat([attention.q_proj(h), attention.k_proj(h)], -1), attention.v_proj(h)
        kv_heads = value.shape[-1] // head
        heads = qk.shape[-1] // head - kv_heads
        # rotary positions on query and key heads in one go, as (b, n, heads, head_dim) rows
        rotated = _rotate(qk.view(b, n, heads + kv_heads, head), cos, sin).transpose(1, 2)
        query, key = rotated[:, :heads], rotated[:, heads:]
        key, value = cache.update(key, value.view(b, n, kv_heads, head).transpose(1, 2), index)
        out = F.scaled_dot_product_attention(query.reshape(b, kv_heads, self.groups * n, head), key, value,
                                             attn_mask=mask, scale=attention.scaling)
        return attention.o_proj(out.reshape(b, heads, n, head).transpose(1, 2).reshape(b, n, heads * head))


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin, rounded as Transformers rounds it, in four ops where it spends five (a launch
    each on a GPU): rotate_half(x) is x's halves swapped (a roll) with the first negated, and that sign is already
    in `signed_sin` (negating is exact, so each product is the same number)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
