"""How a drafter picks the children of a tree node, in the way its verifier needs to stay exact.

- "top_k": deterministic, most probable first. Works on scores (logits, `-inf` = banned) or on probabilities;
  greedy and target-matching ("target_sample") verification accept any deterministic tree.
- "without_replacement": sequential sampling without replacement from the draft distribution, drafting order
  = sampling order (what the "sequoia" verifier assumes).
- "with_replacement": i.i.d. draws from the draft distribution, duplicates allowed ("specinfer").

Result: a `(m, max(k))` long tensor, row i holding node i's children in drafting order. Slots that could not
be filled (row i wants fewer than `max(k)` children, or fewer tokens are available than it wants) hold -1,
always after the valid ones; drafters drop them. Available tokens are those with score > -inf in "top_k"
(pass log-probabilities there to exclude zero-probability tokens) and those with probability > 0 when sampling.
"""

from __future__ import annotations

import torch

from .wide_rows import row_topk

CHILD_SELECTIONS = ("top_k", "without_replacement", "with_replacement")


def select_children(
    probs: torch.Tensor,
    k: int | list[int] | torch.Tensor,
    mode: str,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick up to `k[i]` children for each row of `probs` `(m, V)`; see the module doc for modes and padding.

    Sampling modes expect non-negative (not necessarily normalized) probabilities.
    """
    if mode not in CHILD_SELECTIONS:
        raise ValueError(f"Unknown child selection {mode!r}; expected one of {', '.join(CHILD_SELECTIONS)}.")
    m, vocab = probs.shape
    device = probs.device
    if isinstance(k, torch.Tensor):
        k = k.tolist() if k.dim() else int(k)
    want_list = list(k) if isinstance(k, (list, tuple)) else [int(k)] * m
    width = max(want_list, default=0)  # known on the host: no device read
    if width == 0 or m == 0:
        return torch.full((m, width if m else 0), -1, dtype=torch.long, device=device)
    if mode != "top_k":  # also catches NaN; checked on the device, without waiting for it
        torch._assert_async((probs >= 0).all(), "select_children: sampling modes need non-negative probabilities.")
    if mode == "with_replacement":
        ok_rows = (probs > 0).any(-1)
        safe = torch.where(ok_rows[:, None], probs, torch.ones_like(probs))
        picked = torch.multinomial(safe.float().to(_random_device(generator, device)), width, replacement=True,
                                   generator=generator).to(device)
        valid = ok_rows[:, None].expand(m, width)
    else:
        keys = probs.float()
        if mode == "without_replacement":
            # Exponential race: arrival times E / p with E ~ Exp(1) come in the order of a sequential draw without
            # replacement (what torch.multinomial does). Keys log(U) / p = -E / p, largest first: 4x faster than
            # exponential_ on CPU, and zero-probability tokens get -inf, so rows with few candidates still work.
            uniform = torch.rand(probs.shape, generator=generator, device=_random_device(generator, device))
            keys = uniform.to(device).log_().div_(keys)
        values, picked = row_topk(keys, min(width, vocab))
        valid = values > float("-inf")
        if picked.shape[1] < width:
            pad = width - picked.shape[1]
            picked = torch.cat([picked, picked.new_full((m, pad), -1)], dim=1)
            valid = torch.cat([valid, valid.new_zeros((m, pad))], dim=1)
    if any(want != width for want in want_list):  # rows wanting fewer: their slots past `want` are masked
        wanted = torch.arange(width) < torch.tensor(want_list, dtype=torch.long)[:, None]  # built on the host
        valid = valid & wanted.to(device, non_blocking=True)
    return torch.where(valid, picked, -1)


def _random_device(generator: torch.Generator | None, device: torch.device) -> torch.device:
    """Where draws come from: the generator's own device (a CUDA `speculation_generator` with a CPU draft, or the
    reverse), else where the probabilities are."""
    return generator.device if generator is not None else device
