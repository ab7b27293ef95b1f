"""How a model attends, as far as tree attention cares: which layers see every earlier position and which only a
sliding window of them, where a learned position table ends, and which models a tree cannot run on at all.

The one place tree masks are built: the target's verification pass, the draft runner and latency timing all call
`AttentionLayout.masks`. Caches stay full length (`DynamicCache()` without a config): compaction moves rows, which a
sliding-window cache layer that already dropped its oldest rows cannot do, so the window goes into the mask instead,
by position: a query at position q sees a key at position k when q - k < window (Transformers' own rule,
`masking_utils.sliding_window_overlay`). A 4-D mask reaches every layer unchanged, so models whose layers differ
(Gemma 2/3, gpt-oss, Qwen2 with max_window_layers) get one mask per layer type, as a dict.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

from ..core.releases import ASSISTED_ON_RECURRENT_STATE, RELEASE, keeps_recurrent_state
from ..core.tree import TokenTree, additive_mask

FULL, SLIDING = "full_attention", "sliding_attention"
ROW_MASKED = ("gpt_neo",)  # families that mask attention by cache row on top of the mask they are given
Masks = torch.Tensor | dict[str, torch.Tensor]
# SDPA kernels for tree masks on a CUDA GPU: cuDNN's left out. Measured on an H100 (torch 2.11, bf16, a 7B-shaped Qwen2,
# eager passes, benchmarks/results/gpu-h100/): in a batch of 4, each masked attention call with cuDNN spent 1.45 ms of
# host time (the batch ran 0.49x plain; without it 1.73x); one sequence's `sequoia`, whose tree sizes change every step,
# spent 69 ms a target pass and 22 ms a draft pass with it against 34 and 3.5 without (24 -> 64 tokens/s).
# PyTorch then picks flash (no mask) or memory-efficient attention (a mask).
TREE_KERNELS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


@dataclass(frozen=True)
class AttentionLayout:
    """Per layer, full or sliding-window attention; the sliding layers' window; the learned position limit."""

    layer_types: tuple[str, ...]
    window: int | None = None  # keys a window or more behind the query are hidden in sliding layers
    position_limit: int | None = None  # a learned position table: positions 0 .. limit - 1 exist, no others

    @classmethod
    def of(cls, model: PreTrainedModel) -> AttentionLayout:
        """The layout Transformers itself uses for `model`'s cache and masks (call `check_supported` first)."""
        types, kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
        windows = [kw["sliding_window"] for kind, kw in zip(types, kwargs) if kind == SLIDING]
        return cls(tuple(types), min(windows) if windows else None, learned_position_limit(model))

    def masks(
        self,
        allowed: torch.Tensor,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> Masks:
        """The additive mask(s) of one forward pass.

        `allowed` `(q, kv)` says which cached or new token each query may see (causality, tree ancestry);
        `query_positions` `(q,)` and `key_positions` `(kv,)` are real positions (a tree node's is past + depth).
        Built where `allowed` is (on the host, a pass's masks cross to `device` in one copy per layer type).
        One `(1, 1, q, kv)` tensor when every layer attends alike, else a dict keyed by layer type.
        """
        out = {}
        for kind in dict.fromkeys(self.layer_types):
            visible = allowed
            if kind == SLIDING:
                gap = query_positions.to(allowed.device)[:, None] - key_positions.to(allowed.device)[None, :]
                visible = allowed & (gap < self.window)
            elif kind != FULL:
                raise ValueError(f"No tree mask for {kind!r} layers: check_supported() refuses such models.")
            out[kind] = additive_mask(visible, dtype).to(device or allowed.device, non_blocking=True)
        return next(iter(out.values())) if len(out) == 1 else out

    def tree_masks(self, tree: TokenTree, past_length: int, dtype: torch.dtype, device: torch.device | None = None):
        """The mask(s) of a pass over `tree` after `past_length` cached tokens at positions 0 .. past_length - 1,
        built on the host from the tree's host structure and copied once to `device` (default: the tree's)."""
        host = tree.host()
        nodes = host.structure()[0] + past_length
        keys = torch.cat([torch.arange(past_length), nodes])
        return self.masks(host.visibility(past_length), nodes, keys, dtype, device or tree.device)

    def deepest_node(self, past_length: int) -> int | None:
        """The deepest tree node the model can place after `past_length` tokens (None: positions never run out)."""
        return None if self.position_limit is None else self.position_limit - 1 - past_length

    def model_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Position ids a forward pass can take: past a learned table's end, the last row it has.

        Only drafts use this (a draft whose table ends before the target's, or a draft node the target will cut
        anyway): their proposals get weaker there, never wrong, since the target verifies every token.
        """
        return positions if self.position_limit is None else positions.clamp(max=self.position_limit - 1)


def learned_position_limit(model: PreTrainedModel) -> int | None:
    """`max_position_embeddings` when a position table holds that many rows (GPT-2's `wpe`, OPT's learned
    `embed_positions` with its offset of 2, GPT-J's fixed sinusoid buffer); None for rotary embeddings computed on the
    fly, ALiBi or no positions, which go on past it."""
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    try:
        tokens = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        tokens = None
    rows = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding) and m is not tokens]
    rows += [buffer.shape[0] for name, buffer in model.named_buffers() if "embed_positions" in name and buffer.dim()]
    return limit if any(limit <= count <= limit + 2 for count in rows) else None


RECURRENT = "it keeps a recurrent state (Mamba, linear-attention or convolution layers)"
#: the cache layers a chain rolls back on a model with recurrent state (with Transformers' own `Cache.crop`)
CHAIN_LAYERS = (DynamicLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer)


def keeps_state(model: PreTrainedModel) -> bool:
    """Whether `model` keeps a recurrent state: a tree cannot run on it, a chain can (`unsupported_reason`)."""
    try:
        layers = DynamicCache(config=model.config.get_text_config(decoder=True)).layers
    except Exception:  # noqa: BLE001 (a cache of its own kind: judged by its flag alone)
        layers = []
    return keeps_recurrent_state(model, layers)


def unsupported_reason(model: PreTrainedModel, chain: bool = False) -> str | None:
    """Why a tree (a `chain`: one drafted token per level) cannot run on `model`, or None: every layer must keep a
    plain per-token key/value cache with full or sliding-window attention, and the forward pass must take a 4-D mask
    and explicit position ids. A chain also runs where layers keep a recurrent state that Transformers rolls back
    (5.25 on): it needs no tree mask, and keeps a prefix of what it forwarded."""
    config = model.config.get_text_config(decoder=True)
    supports_dynamic_cache = getattr(model, "_supports_default_dynamic_cache", None)
    try:
        types, kwargs = get_layer_types_and_kwargs(config)
        layers = DynamicCache(config=config).layers
    except Exception as exc:  # noqa: BLE001 (a layer type Transformers' DynamicCache cannot build)
        types, kwargs, layers, error = [], [], [], exc
    else:
        error = None
    if keeps_recurrent_state(model, layers):
        if not chain:
            return f"{RECURRENT}, which cannot be rolled back to the accepted path of a tree"
        if not ASSISTED_ON_RECURRENT_STATE:
            return f"{RECURRENT}, which Transformers rolls back from 5.25 on (installed: {RELEASE})"
        odd = sorted({type(layer).__name__ for layer in layers if type(layer) not in CHAIN_LAYERS})
        if odd or error is not None or (supports_dynamic_cache is not None and not supports_dynamic_cache()):
            kind = f"{', '.join(odd)} layers" if odd else "a cache of its own kind"
            return f"{RECURRENT} beside {kind}, which Transformers' rollback cannot restore"
        return None
    if supports_dynamic_cache is not None and not supports_dynamic_cache():
        return "it keeps a cache of its own kind instead of Transformers' DynamicCache"
    if error is not None:
        return f"its cache layout cannot be built from its config ({error})"
    other = sorted(set(types) - {FULL, SLIDING})
    if other:
        return f"it has {', '.join(other)} layers, and tree masks exist only for full and sliding-window attention"
    plain = (DynamicLayer, DynamicSlidingWindowLayer)
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) not in plain})
    if odd:
        return f"its cache holds {', '.join(odd)} layers, not plain per-token keys and values"
    windows = {kw.get("sliding_window") for kind, kw in zip(types, kwargs) if kind == SLIDING}
    if len(windows) > 1 or None in windows:
        return f"its sliding-window layers use different windows ({sorted(map(str, windows))}), one mask per layer type"
    if uses_alibi(config):
        return "it adds ALiBi position biases computed from a 2-D mask, which cannot follow a token's depth in a tree"
    if config.model_type in ROW_MASKED:
        return ("its attention applies a causal table of its own by cache row (and windows its local layers by row), "
                "not by position, so tree nodes would see wrong keys")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return "its forward takes no position_ids, so tree nodes cannot be placed at their depth"
    return None


def uses_alibi(config) -> bool:
    """ALiBi families: Falcon with alibi=True, MPT (attn_config.alibi), BLOOM (always)."""
    attn = getattr(config, "attn_config", None)
    return bool(getattr(config, "alibi", False) or getattr(attn, "alibi", False) or config.model_type == "bloom")


def check_supported(model: PreTrainedModel, role: str, chain: bool = False) -> None:
    """Raise a ValueError naming the model, the reason and the fix when a tree (a `chain`) cannot run on it."""
    reason = unsupported_reason(model, chain)
    if reason is None:
        return
    family = model.config.get_text_config(decoder=True).model_type
    if reason.startswith(RECURRENT) and unsupported_reason(model, chain=True) is None:
        fix = "pass speculation='chain', which rolls the state back along its chain, or drop `speculation`"
    elif reason.startswith(RECURRENT) and not ASSISTED_ON_RECURRENT_STATE:
        fix = "pip install -U 'transformers>=5.25' for speculation='chain', or drop `speculation`"
    elif role == "target":
        fix = "generate without `speculation=` for this model (Transformers' own decoding)"
    else:
        fix = (f"pass as {role} a model whose layers all run full or sliding-window attention (Llama, Qwen, Mistral, "
               "Gemma, Phi, GPT-2, OPT, ...), or generate without `speculation=`")
    raise ValueError(f"The {role} {type(model).__name__} ({family}) cannot be used for speculation: {reason}; {fix}.")


def tree_attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels a call's eager tree passes run with, for the call only: on CUDA, `TREE_KERNELS` (the user's
    settings come back after the call); elsewhere whatever PyTorch picks."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(list(TREE_KERNELS))
