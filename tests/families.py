"""Model families of Transformers and what hf_specdec does with each: lossless speculation, or a refusal up front.

One list, used twice: `tests/test_families.py` runs every family on a tiny random model of it (each supported one
greedy token-identical to plain `generate` with tree, sequoia, specexec and staged; each refused one raising before
anything runs), and README's compatibility matrix is generated from it (`hf-specdec families --readme README.md`),
so the README never claims what the test does not check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tests.tiny import IDS, build

WINDOW = 8  # sliding windows of the tiny models: generation crosses them many times
POSITIONS = 40  # learned position tables of the tiny models: the tests generate up to their last position
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)

TRAIT_NOTES = {
    "sliding": f"sliding-window attention (window {WINDOW} here): the window is applied by position in the tree masks",
    "mixed": "full and sliding-window layers: one tree mask per layer type",
    "learned": "learned absolute positions: trees are cut at the table's last position, as far as plain generate goes",
    "types": "token type ids: each tree node gets the type plain generate gives a new token (the prompt's last)",
    "images": "images (pixel values, one image token here) reach the prompt's pass, as in plain generate",
    "table": "rotary angles from a fixed table of max positions: trees are cut at its last position, as plain generate "
             "stops there",
}


@dataclass(frozen=True)
class Family:
    """A model family, how to build a tiny random one, and what speculation does with it."""

    name: str
    model: str  # the Transformers class AutoModelForCausalLM (Seq2SeqLM for encoder-decoders) builds
    config: str  # its config class
    kwargs: dict[str, Any] = field(default_factory=dict)
    attn: str = "sdpa"  # "eager" where the family has no SDPA path
    traits: tuple[str, ...] = ()  # keys of TRAIT_NOTES
    refused: str | None = None  # a phrase of the error every refused call raises; None: supported
    why: str = ""  # README's note for a refused family
    chains: bool = False  # refused for trees, but `chain` runs lossless (a recurrent state rolled back, 5.25 on)

    @property
    def supported(self) -> bool:
        return self.refused is None

    @property
    def position_limit(self) -> int | None:
        if "learned" in self.traits or "table" in self.traits:
            return self.kwargs.get("n_positions", self.kwargs.get("max_position_embeddings"))
        return None

    def build(self, seed: int = 0, vocab_size: int | None = None) -> torch.nn.Module:
        """A tiny random float32 model of this family in eval mode, sharpened, generating without eos."""
        import transformers

        kwargs = dict(self.kwargs, **({"vocab_size": vocab_size} if vocab_size else {}))
        return build(getattr(transformers, self.config)(**kwargs), seed, attn=self.attn)


def _with(**extra: Any) -> dict[str, Any]:
    return {**TINY, **extra}


def _without(*names: str, **extra: Any) -> dict[str, Any]:
    return {k: v for k, v in _with(**extra).items() if k not in names}


FAMILIES: tuple[Family, ...] = (
    Family("Llama", "LlamaForCausalLM", "LlamaConfig", _with()),
    Family("Qwen2", "Qwen2ForCausalLM", "Qwen2Config", _with()),
    Family("Qwen2 (sliding window)", "Qwen2ForCausalLM", "Qwen2Config",
           _with(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), traits=("sliding", "mixed")),
    Family("Qwen3", "Qwen3ForCausalLM", "Qwen3Config", _with(head_dim=8)),
    Family("Qwen3-MoE", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
           _with(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    Family("Mistral (sliding window)", "MistralForCausalLM", "MistralConfig", _with(sliding_window=WINDOW),
           traits=("sliding",)),
    Family("Mistral (sliding window, eager)", "MistralForCausalLM", "MistralConfig", _with(sliding_window=WINDOW),
           attn="eager", traits=("sliding",)),
    Family("Mixtral (sliding window)", "MixtralForCausalLM", "MixtralConfig", _with(sliding_window=WINDOW, **MOE),
           traits=("sliding",)),
    Family("Gemma", "GemmaForCausalLM", "GemmaConfig", _with(head_dim=8)),
    Family("Gemma 2", "Gemma2ForCausalLM", "Gemma2Config", _with(head_dim=8, sliding_window=WINDOW), attn="eager",
           traits=("sliding", "mixed")),
    Family("Gemma 3 (text)", "Gemma3ForCausalLM", "Gemma3TextConfig",
           _with(head_dim=8, sliding_window=WINDOW, sliding_window_pattern=2), traits=("sliding", "mixed")),
    Family("Gemma 3 (vision-language)", "Gemma3ForConditionalGeneration", "Gemma3Config",
           dict(text_config=_with(head_dim=8, sliding_window=WINDOW, sliding_window_pattern=2),
                vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=8, patch_size=4, num_channels=3),
                mm_tokens_per_image=1, image_token_index=5, boi_token_index=3, eoi_token_index=4, **IDS),
           traits=("sliding", "mixed", "images")),
    Family("Phi", "PhiForCausalLM", "PhiConfig", _without("num_key_value_heads")),
    Family("Phi-3 (sliding window)", "Phi3ForCausalLM", "Phi3Config", _with(sliding_window=WINDOW),
           traits=("sliding",)),
    Family("GPT-2", "GPT2LMHeadModel", "GPT2Config",
           dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=POSITIONS, **IDS),
           traits=("learned", "types")),
    Family("GPTBigCode (StarCoder 1)", "GPTBigCodeForCausalLM", "GPTBigCodeConfig",
           dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=POSITIONS, **IDS),
           traits=("learned", "types")),
    Family("GPT-NeoX", "GPTNeoXForCausalLM", "GPTNeoXConfig", _without("num_key_value_heads")),
    Family("GPT-J", "GPTJForCausalLM", "GPTJConfig",
           dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256, **IDS), attn="eager",
           traits=("table", "types")),
    Family("Falcon", "FalconForCausalLM", "FalconConfig",
           dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **IDS)),
    Family("OPT", "OPTForCausalLM", "OPTConfig",
           dict(vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                word_embed_proj_dim=32, max_position_embeddings=POSITIONS, **IDS), traits=("learned",)),
    Family("StarCoder2 (sliding window)", "Starcoder2ForCausalLM", "Starcoder2Config", _with(sliding_window=WINDOW),
           traits=("sliding",)),
    Family("OLMo 2", "Olmo2ForCausalLM", "Olmo2Config", _with()),
    Family("Granite", "GraniteForCausalLM", "GraniteConfig", _with()),
    Family("Cohere", "CohereForCausalLM", "CohereConfig", _with()),
    Family("GLM", "GlmForCausalLM", "GlmConfig", _with(head_dim=8)),
    Family("gpt-oss", "GptOssForCausalLM", "GptOssConfig", _with(head_dim=8, sliding_window=WINDOW, **MOE),
           attn="eager", traits=("sliding", "mixed")),
    # Refused before anything runs, with the reason and the fix in the message (`chains`: refused for trees only).
    Family("Mamba", "MambaForCausalLM", "MambaConfig",
           dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=4, **IDS), attn="eager",
           refused="recurrent state", why="recurrent state (selective SSM): cannot be rolled back to a tree path",
           chains=True),
    Family("Mamba2", "Mamba2ForCausalLM", "Mamba2Config",
           dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=4,
                n_groups=1, **IDS), attn="eager",
           refused="recurrent state", why="recurrent state (SSD): cannot be rolled back to a tree path",
           chains=True),
    Family("Jamba", "JambaForCausalLM", "JambaConfig",
           _with(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                 num_experts=2, mamba_d_state=4, mamba_expand=2, mamba_dt_rank=4),
           refused="recurrent state", chains=True,
           why="hybrid attention + Mamba layers: the Mamba state cannot be rolled back to a tree path"),
    Family("Falcon-H1", "FalconH1ForCausalLM", "FalconH1Config",
           _with(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=4),
           refused="recurrent state", chains=True,
           why="hybrid attention + Mamba layers: the Mamba state cannot be rolled back to a tree path"),
    Family("Qwen3-Next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
           _with(head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                 linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32, full_attention_interval=2),
           refused="recurrent state", why="linear-attention (gated DeltaNet) layers keep a recurrent state",
           chains=True),
    Family("LFM2", "Lfm2ForCausalLM", "Lfm2Config", _with(full_attn_idxs=[1]),
           refused="recurrent state", why="short convolution layers keep a rolling state",
           chains=True),
    Family("RecurrentGemma", "RecurrentGemmaForCausalLM", "RecurrentGemmaConfig",
           dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                lru_width=32, attention_window_size=8, **IDS),
           refused="recurrent state", why="RG-LRU recurrent layers keep a state"),
    Family("Falcon (ALiBi)", "FalconForCausalLM", "FalconConfig",
           dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, **IDS),
           refused="ALiBi", why="ALiBi biases are built from a 2-D mask by cache index, not by a node's depth"),
    Family("BLOOM", "BloomForCausalLM", "BloomConfig",
           dict(vocab_size=96, hidden_size=32, n_layer=2, n_head=4, **IDS), attn="eager",
           refused="ALiBi", why="ALiBi biases are built from a 2-D mask by cache index, not by a node's depth"),
    Family("MPT", "MptForCausalLM", "MptConfig", dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, **IDS),
           attn="eager", refused="ALiBi", why="ALiBi biases are built from a 2-D mask by cache index, not by depth"),
    Family("GPT-Neo", "GPTNeoForCausalLM", "GPTNeoConfig",
           dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                window_size=WINDOW, **IDS), attn="eager",
           refused="by cache row", why="a causal table (and local windows) applied by cache row, not by position"),
    Family("T5 (encoder-decoder)", "T5ForConditionalGeneration", "T5Config",
           dict(vocab_size=96, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0,
                **IDS),
           refused="decoder-only", why="encoder-decoder: use Transformers' own assisted generation"),
)


def family(name: str) -> Family:
    """The family called `name` in FAMILIES."""
    for entry in FAMILIES:
        if entry.name == name:
            return entry
    raise KeyError(f"No family {name!r}; known: {', '.join(f.name for f in FAMILIES)}.")


def matrix_markdown() -> str:
    """README's compatibility matrix: one row per family, supported, chains only or refused, and how or why."""
    lines = [
        "| family | Transformers class | speculation | how / why |",
        "|---|---|---|---|",
    ]
    for entry in FAMILIES:
        if entry.supported:
            notes = "; ".join(TRAIT_NOTES[t] for t in entry.traits) or "standard attention and rotary positions"
            lines.append(f"| {entry.name} | `{entry.model}` | lossless | {notes} |")
        elif entry.chains:
            lines.append(f"| {entry.name} | `{entry.model}` | `chain` only (Transformers 5.25+) | {entry.why}; "
                         f"`chain` keeps the state after each drafted token and rolls back to the accepted one |")
        else:
            lines.append(f"| {entry.name} | `{entry.model}` | refused | {entry.why} |")
    return "\n".join(lines)
