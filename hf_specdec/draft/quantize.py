"""A cheaper draft for CPUs: low-bit Linear weights (PyTorch's dynamic int8 by default, or a weight-only scheme).

Every lossless method only asks the draft to propose; the target decides what is kept. A quantized draft
therefore changes no output, only how fast drafts come and how often they are accepted. On CPUs it is often the
largest lever there is: int8 matrix kernels (fbgemm) stay fast for the multi-row passes a tree level needs,
where bfloat16 on a CPU without native bfloat16 costs one single-row pass per row. Schemes (`SCHEMES`), measured
per pass size on whole draft passes in benchmarks/draft_kernels.py: "dynamic-int8" (fbgemm, activations quantized
per tensor: the default, no other scheme beat it on Zen 4), "int4" and "int8-weight-only" (`weight_only.py`,
bfloat16 activations; their cost grows faster with the rows of a pass), offered to measure on other CPUs.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from .vocabulary import restrict_vocabulary
from .weight_only import to_weight_only, weight_only_unavailable

#: quantize_draft's schemes: name -> what it does
SCHEMES = {
    "dynamic-int8": "int8 weights, activations quantized per pass (PyTorch's dynamic quantization, fbgemm)",
    "int4": "int4 weights in groups, bfloat16 activations (aten._weight_int4pack_mm_for_cpu)",
    "int8-weight-only": "int8 weights, bfloat16 activations (aten._weight_int8pack_mm)",
}
WEIGHT_ONLY_BITS = {"int4": 4, "int8-weight-only": 8}


def quantize_draft(
    model: PreTrainedModel, vocabulary: Sequence[int] | torch.Tensor | None = None, scheme: str = "dynamic-int8"
) -> PreTrainedModel:
    """A low-bit copy of `model` for drafting on the CPU; `scheme` is one of `SCHEMES` (default: int8 weights,
    activations quantized per pass; "int4" / "int8-weight-only": weight-only, the copy computes in bfloat16).

    With `vocabulary` (token ids, e.g. from `frequent_tokens`), the copy's output layer covers those tokens only
    (`restrict_vocabulary`): a cheaper pass, and the draft never proposes another token. The original model is left
    untouched (the copy is made in float32 first, which needs about 4 bytes per parameter while it runs). Pass the
    result as `assistant_model=`.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"Unknown draft quantization scheme {scheme!r}: choose one of {', '.join(SCHEMES)}.")
    if model.device.type != "cpu":
        raise ValueError(
            f"quantize_draft makes a CPU draft (PyTorch's dynamic int8 kernels run on CPUs), but the model is on "
            f"{model.device}: move it with .to('cpu') first, or keep a GPU draft in half precision."
        )
    if scheme in WEIGHT_ONLY_BITS:
        return _weight_only_copy(model, vocabulary, scheme)
    try:
        from torch.ao.quantization import quantize_dynamic
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        raise ImportError(
            "This PyTorch build has no torch.ao.quantization.quantize_dynamic: keep the draft unquantized."
        ) from exc
    # nn.Module's float(), not PreTrainedModel's: that one refuses every model Transformers flags as quantized, which
    # includes GGUF loads (`from_pretrained(..., gguf_file=...)`) whose weights its loader already made plain floats.
    draft = torch.nn.Module.float(copy.deepcopy(model)).eval()
    if vocabulary is not None:
        restrict_vocabulary(draft, vocabulary)
    with warnings.catch_warnings():  # torch marks the eager API as deprecated in favour of torchao; it still works
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        quantized = quantize_dynamic(draft, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    quantized.config.hf_specdec_quantization = "dynamic-int8"
    return quantized


def _weight_only_copy(
    model: PreTrainedModel, vocabulary: Sequence[int] | torch.Tensor | None, scheme: str
) -> PreTrainedModel:
    why = weight_only_unavailable(WEIGHT_ONLY_BITS[scheme])
    if why is not None:
        raise RuntimeError(f"quantize_draft(scheme={scheme!r}) cannot run here: {why}. Use scheme='dynamic-int8'.")
    # bfloat16 is what the fused kernels take; nn.Module's to(), for the reason given above
    draft = torch.nn.Module.to(copy.deepcopy(model), torch.bfloat16).eval()
    if vocabulary is not None:
        restrict_vocabulary(draft, vocabulary)
    with torch.no_grad():
        to_weight_only(draft, WEIGHT_ONLY_BITS[scheme])
    draft.config.hf_specdec_quantization = scheme
    return draft


def is_quantized(model: PreTrainedModel) -> bool:
    return getattr(model.config, "hf_specdec_quantization", None) is not None
