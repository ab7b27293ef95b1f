"""The acceptance vector, estimated teacher-forced: p_k = P(the k-th drafted child is the accepted one).

Why teacher-forced rather than decoding with star trees: the vector is a property of the target's and the
draft's distributions (p, q) at the positions the verifier visits, i.e. along the target's own continuation.
We decode that continuation once (losslessly, with speculation), run each model once over it, and then
compute, at every position, the probability that each rank is accepted under the verifier that will be used:
exactly for greedy and target-sample verification, and by simulation (Rao-Blackwellised, so with little
variance) for the residual verifiers. One pass per model per prompt replaces a decoding run per width, and
every position contributes all W ranks instead of one observed outcome.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessorList, PreTrainedModel

from ...logits.child_selection import select_children
from ...runtime.devices import execution_device
from ...runtime.model_info import embeddable

SUPPORT = 1024  # draft tokens simulated per position: q's mass beyond its top 1024 tokens is negligible


@dataclass(frozen=True)
class AcceptanceEstimate:
    """Mean acceptance probability per drafted rank, over `positions` positions."""

    acceptance: list[float]
    positions: int
    verifier: str

    def to_dict(self) -> dict:
        return {"acceptance": self.acceptance, "positions": self.positions, "verifier": self.verifier}


def rank_acceptance(
    target_scores: torch.Tensor,
    draft_scores: torch.Tensor,
    width: int,
    verifier: str,
    samples: int = 128,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`(L, width)` probability that the k-th drafted child is accepted at each of L positions.

    `target_scores`, `draft_scores`: `(L, V)` processed scores (the logits processors already applied).
    Children are drafted the way `verifier` needs: top-k for "greedy" and "target_sample", sampled without
    replacement for "sequoia", with replacement for "specinfer".
    """
    vocab = min(target_scores.shape[-1], draft_scores.shape[-1])
    target_scores, draft_scores = target_scores[:, :vocab].double(), draft_scores[:, :vocab].double()
    if verifier == "greedy":
        ranked = draft_scores.topk(width, dim=-1).indices
        return (ranked == target_scores.argmax(-1, keepdim=True)).double()
    p, q = target_scores.softmax(-1), draft_scores.softmax(-1)
    if verifier == "target_sample":
        return p.gather(1, draft_scores.topk(width, dim=-1).indices)
    if verifier not in ("sequoia", "specinfer"):
        raise ValueError(
            f"No acceptance model for verifier {verifier!r}: use greedy, target_sample, sequoia or specinfer."
        )
    rows = [_simulate_residual(p[i], q[i], width, samples, verifier == "sequoia", generator) for i in range(len(p))]
    return torch.stack(rows)


def _simulate_residual(
    p: torch.Tensor, q: torch.Tensor, width: int, samples: int, without_replacement: bool, generator
) -> torch.Tensor:
    """Expected acceptance per rank under recursive rejection sampling, averaged over `samples` child draws.

    For each drawn sequence of children the verifier's own randomness is integrated out: the weight of
    reaching child k is the product of the earlier rejection probabilities, and the residual update after a
    rejection is deterministic. Tokens outside q's top `SUPPORT` are carried as one lump of p's mass.
    """
    support = q.topk(min(SUPPORT, len(q))).indices
    qs, ps = q[support], p[support]
    qs = qs / qs.sum()
    outside = (1.0 - ps.sum()).clamp(min=0.0).expand(samples).clone()
    P, Q = ps.expand(samples, -1).clone(), qs.expand(samples, -1).clone()
    mode = "without_replacement" if without_replacement else "with_replacement"
    children = select_children(qs.float().expand(samples, -1), width, mode, generator)  # (samples, width), -1 = none
    reach = torch.ones(samples, dtype=torch.float64)
    accepted = torch.zeros(width, dtype=torch.float64)
    rows = torch.arange(samples)
    for k in range(width):
        x = children[:, k]
        valid = x >= 0
        xi = x.clamp(min=0)
        px, qx = P[rows, xi], Q[rows, xi]
        a = torch.where(valid & (qx > 0), (px / qx.clamp(min=1e-300)).clamp(max=1.0), torch.zeros_like(px))
        accepted[k] = (reach * a).mean()
        reach = reach * (1.0 - a)
        residual = (P - Q).clamp(min=0.0)
        mass = residual.sum(-1) + outside
        keep = mass > 1e-12  # else p == q here: rejection had probability 0, reach is already 0
        P = torch.where(keep[:, None] & valid[:, None], residual / mass.clamp(min=1e-300)[:, None], P)
        outside = torch.where(keep & valid, outside / mass.clamp(min=1e-300), outside)
        if without_replacement:
            Q[rows[valid], xi[valid]] = 0.0
            Q = Q / Q.sum(-1, keepdim=True).clamp(min=1e-300)
    return accepted


def teacher_forced_scores(
    model: PreTrainedModel, sequence: torch.Tensor, start: int, processors: LogitsProcessorList | None
) -> torch.Tensor:
    """Processed scores `(len(sequence) - start, V)` predicting tokens `start ..` of `sequence` `(L,)`, one pass."""
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)  # a draft padded to fewer rows
    with torch.no_grad():
        logits = model(input_ids=embeddable(sequence, rows)[None].to(execution_device(model))).logits
    logits = logits[0, start - 1 : -1].float().cpu()
    if processors:
        for i in range(len(logits)):  # each position with its own prefix, as generate would
            logits[i] = processors(sequence[None, : start + i], logits[i][None])[0]
    return logits


def estimate_acceptance(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    sequences: list[tuple[torch.Tensor, int]],
    width: int,
    verifier: str,
    processors: LogitsProcessorList | None = None,
    samples: int = 128,
    seed: int = 0,
    progress: bool = True,
) -> AcceptanceEstimate:
    """Average `rank_acceptance` over every generated position of `sequences` (each: token ids `(L,)`, prompt length).

    The sequences should be the target's own continuations at the temperature being calibrated.
    """
    generator = torch.Generator().manual_seed(seed)
    total, positions = torch.zeros(width, dtype=torch.float64), 0
    for ids, prompt_length in tqdm(sequences, desc="acceptance", unit="prompt", disable=not progress):
        target_scores = teacher_forced_scores(target, ids, prompt_length, processors)
        draft_scores = teacher_forced_scores(draft, ids, prompt_length, processors)
        per_position = rank_acceptance(target_scores, draft_scores, width, verifier, samples, generator)
        total += per_position.sum(0)
        positions += len(per_position)
    if not positions:
        raise ValueError("No generated positions to calibrate on: give prompts and max_new_tokens >= 1.")
    acceptance = (total / positions).clamp(0.0, 1.0).tolist()
    scale = sum(acceptance)
    if scale > 1.0:  # float noise only: ranks are exclusive events
        acceptance = [a / scale for a in acceptance]
    return AcceptanceEstimate(acceptance, positions, verifier)
