"""A cheaper draft for CPUs: low-bit Linear weights (PyTorch's dynamic int8 by default, or a weight-only scheme).

Every lossless method only asks the draft to propose; the target decides what is kept. A quantized draft
therefore changes no output, only how fast drafts come and how often they are accepted. On CPUs it is often the
largest lever there is: int8 matrix kernels (fbgemm) stay fast for the multi-row passes a tree level needs,
where bfloat16 on a CPU without native bfloat16 costs one single-row pass per row. Schemes (`SCHEMES`), measured
per pass size on whole draft passes in `studies.draft_kernels`: "dynamic-int8" (fbgemm, activations quantized
per tensor), "int4" and "int8-weight-only" (`weight_only.py`, bfloat16 activations; their cost grows
faster with the rows of a pass), and "mixed" (`row_dispatch.py`: int4 for the narrow passes where it measures
faster here, dynamic int8 for the wide ones, bfloat16 weights for a prompt's pass where they measure faster, as on
CPUs with AMX: `row_dispatch.py`). The default, "auto", is "mixed" on CPUs that multiply bfloat16
natively and dynamic int8 elsewhere: measured in one process on Zen 4 with the real pair (8 prompts x 64 tokens,
greedy), "mixed" against dynamic int8 gave sequoia 2.12x plain against 1.89x on HumanEval and 1.50x against 1.42x
on code continuations, and accepted more tokens per step (int4 weights with bfloat16 activations stay closer to the
float draft than int8 activations quantized per tensor); `staged`, whose passes are wide, lost 8% on code.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from ..plan.latency import measure_latency
from ..runtime.devices import native_bfloat16
from .row_dispatch import MAX_NARROW_ROWS, RowDispatchLinear, set_broad_rows, set_narrow_rows, split_by_rows
from .vocabulary import restrict_vocabulary
from .weight_only import to_weight_only, weight_only_unavailable

#: quantize_draft's schemes: name -> what it does
SCHEMES = {
    "dynamic-int8": "int8 weights, activations quantized per pass (PyTorch's dynamic quantization, fbgemm)",
    "int4": "int4 weights in groups, bfloat16 activations (aten._weight_int4pack_mm_for_cpu)",
    "int8-weight-only": "int8 weights, bfloat16 activations (aten._weight_int8pack_mm)",
    "mixed": "int4 weight-only for passes of a few rows (as many as measure faster here), dynamic int8 for wider "
             "ones, bfloat16 for the broadest (a prompt's pass; from the row count that measures faster here)",
}
WEIGHT_ONLY_BITS = {"int4": 4, "int8-weight-only": 8}
AUTO = "auto"  # "mixed" where bfloat16 is native and the int4 kernel exists, else "dynamic-int8"


def default_scheme() -> str:
    """What `scheme="auto"` means on this machine (see the module's docstring for the measurements)."""
    return "mixed" if native_bfloat16(cuda=False) and weight_only_unavailable(4) is None else "dynamic-int8"


def quantize_draft(
    model: PreTrainedModel, vocabulary: Sequence[int] | torch.Tensor | None = None, scheme: str = AUTO
) -> PreTrainedModel:
    """A low-bit copy of `model` for drafting on the CPU; `scheme` is one of `SCHEMES` or "auto" (the default:
    "mixed" on a CPU with native bfloat16, else "dynamic-int8"). "dynamic-int8": int8 weights, activations quantized
    per pass; "int4" / "int8-weight-only": weight-only, the copy computes in bfloat16; "mixed": both int4 and int8
    weights, each pass takes the one measured faster here for its row count (measured while building, ~2 s).

    With `vocabulary` (token ids, e.g. from `frequent_tokens`), the copy's output layer covers those tokens only
    (`restrict_vocabulary`): a cheaper pass, and the draft never proposes another token. The original model is left
    untouched (the copy is made in float32 first, which needs about 4 bytes per parameter while it runs). Pass the
    result as `assistant_model=`.
    """
    if scheme not in (AUTO, *SCHEMES):
        raise ValueError(f"Unknown draft quantization scheme {scheme!r}: choose one of auto, {', '.join(SCHEMES)}.")
    if model.device.type != "cpu":
        raise ValueError(
            f"quantize_draft makes a CPU draft (PyTorch's dynamic int8 kernels run on CPUs), but the model is on "
            f"{model.device}: move it with .to('cpu') first, or keep a GPU draft in half precision."
        )
    scheme = default_scheme() if scheme == AUTO else scheme
    if scheme in WEIGHT_ONLY_BITS:
        return _weight_only_copy(model, vocabulary, scheme)
    if scheme == "mixed" and (why := weight_only_unavailable(4)) is not None:
        raise RuntimeError(f"quantize_draft(scheme='mixed') cannot run here: {why}. Use scheme='dynamic-int8'.")
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
    if scheme == "mixed":
        with torch.no_grad():
            # int4 and bfloat16 copies beside each layer; the float layers become int8 next
            split_by_rows(draft, MAX_NARROW_ROWS, broad=True, not_broad=[draft.get_output_embeddings()])
    with warnings.catch_warnings():  # torch marks the eager API as deprecated in favour of torchao; it still works
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        quantized = quantize_dynamic(draft, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    quantized.config.hf_specdec_quantization = scheme
    if scheme == "mixed":
        # bfloat16 between the layers (as the int4 kernel computes); the int8 layers take float32 and give it back
        torch.nn.Module.to(quantized, torch.bfloat16)
        set_narrow_rows(quantized, narrow_rows_here(quantized))
        set_broad_rows(quantized, broad_rows_here(quantized))
    return quantized


def narrow_rows_here(model: PreTrainedModel, rows: tuple[int, ...] = tuple(range(1, MAX_NARROW_ROWS + 1))) -> int:
    """The most rows up to which `model`'s int4 kernels measure faster than its int8 ones on this machine (0: never),
    timed on whole passes after 256 cached tokens (a second or two on a CPU)."""
    seconds = {}
    for narrow in (0, MAX_NARROW_ROWS):
        set_narrow_rows(model, narrow)
        seconds[narrow] = measure_latency(model, rows, repeats=3, progress=False, stop_ratio=None).seconds
    return faster_prefix(rows, seconds[MAX_NARROW_ROWS], seconds[0])


#: the pass widths `broad_rows_here` times: from a tree's wide level to a prompt's pass
BROAD_ROWS = (16, 32, 64, 128, 256, 512)


def broad_rows_here(model: torch.nn.Module, rows: Sequence[int] = BROAD_ROWS, repeats: int = 3) -> int:
    """The fewest of `rows` from which the bfloat16 copies of `model`'s `RowDispatchLinear`s measure faster than their
    int8 kernels at every wider count (0: at none). Timed on the layers themselves, one of each weight shape counted
    as often as it occurs (a pass's matrix products; the rest of a pass is the same either way): a fraction of a
    second, where whole passes over 512 rows would take seconds."""
    shapes: dict[tuple[int, int], list] = {}
    for module in model.modules():
        if isinstance(module, RowDispatchLinear) and module.broad_weight is not None:
            shapes.setdefault((module.in_features, module.out_features), [module, 0])[1] += 1
    if not shapes:
        return 0

    def seconds(broad_rows: int, n: int) -> float:
        total = 0.0
        for layer, count in shapes.values():
            x, kept = torch.randn(n, layer.in_features, dtype=torch.bfloat16), layer.broad_rows
            layer.broad_rows = broad_rows
            with torch.no_grad():
                layer(x)  # warm
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    layer(x)
                    times.append(time.perf_counter() - start)
            layer.broad_rows = kept
            total += count * statistics.median(times)
        return total

    return faster_suffix(rows, [seconds(1, n) for n in rows], [seconds(0, n) for n in rows])


def faster_suffix(rows: Sequence[int], candidate: Sequence[float], baseline: Sequence[float]) -> int:
    """The smallest row count from which `candidate` is faster than `baseline` at every measured count (0: none)."""
    return faster_prefix(rows[::-1], candidate[::-1], baseline[::-1])


def faster_prefix(rows: Sequence[int], candidate: Sequence[float], baseline: Sequence[float]) -> int:
    """The largest row count up to which `candidate` is faster than `baseline` at every measured count (0: none)."""
    best = 0
    for n, mine, theirs in zip(rows, candidate, baseline):
        if mine >= theirs:
            break
        best = n
    return best


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
