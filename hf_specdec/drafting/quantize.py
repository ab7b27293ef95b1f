"""A cheaper draft for CPUs: int8 weights through PyTorch's dynamic quantization of the Linear layers.

Every lossless method only asks the draft to propose; the target decides what is kept. A quantized draft
therefore changes no output, only how fast drafts come and how often they are accepted. On CPUs it is often the
largest lever there is: int8 matrix kernels (fbgemm) stay fast for the multi-row passes a tree level needs,
where bfloat16 on a CPU without native bfloat16 costs one single-row pass per row.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from .vocabulary import restrict_vocabulary


def quantize_draft(
    model: PreTrainedModel, vocabulary: Sequence[int] | torch.Tensor | None = None
) -> PreTrainedModel:
    """An int8 copy of `model` for drafting on the CPU: Linear weights int8, activations quantized per pass.

    With `vocabulary` (token ids, e.g. from `frequent_tokens`), the copy's output layer covers those tokens only
    (`restrict_vocabulary`): a cheaper pass, and the draft never proposes another token. The original model is left
    untouched (the copy is made in float32 first, which needs about 4 bytes per parameter while it runs). Pass the
    result as `assistant_model=`.
    """
    if model.device.type != "cpu":
        raise ValueError(
            f"quantize_draft makes a CPU draft (PyTorch's dynamic int8 kernels run on CPUs), but the model is on "
            f"{model.device}: move it with .to('cpu') first, or keep a GPU draft in half precision."
        )
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


def is_quantized(model: PreTrainedModel) -> bool:
    return getattr(model.config, "hf_specdec_quantization", None) is not None
