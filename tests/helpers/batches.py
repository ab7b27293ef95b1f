"""Left-padded batches of random prompts, a draft that agrees with its target often but not always, and the
sized-batch fixtures the batch tests share."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from hf_specdec.methods.sequoia.dp import plan_tree
from hf_specdec.plan.latency import LatencyCurve
from hf_specdec.plan.sizing import HardwareProfile
from tests.conftest import VOCAB

NEW = 20


WHOLE_CHAIN_3 = {"num_draft_tokens": 3, "confidence_threshold": 0, "guard": False}  # 3 tokens, every step


def near_draft(target, noise: float = 0.2, seed: int = 1):
    """The target with noise on every weight: it agrees with the target often, not always, so rows accept different
    numbers of tokens in the same step (ragged acceptance) and finish after different numbers of steps."""
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * noise * weight.std())
    return draft


def padded_batch(seed: int, pads: list[int], length: int = 9) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Prompts of `length - pads[r]` tokens (ids >= 3), left-padded with 0 as a tokenizer pads them."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(pads), length), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def kwargs_for(method: str, draft) -> dict:
    """"sequoia" drafts a given 12-node plan; "sequoia-online" looks one up (calibrated online on the first row)."""
    kwargs = {"speculation": method.removesuffix("-online")}
    if method == "sequoia":
        kwargs["speculation_config"] = {"plan": plan_tree([0.6, 0.2, 0.1, 0.05], 12, 5)}
    return {**kwargs, **({} if method == "prompt_lookup" else {"assistant_model": draft})}


def eos_firing_in_one_row(target, ids, mask) -> int:
    """A token plain greedy decoding emits early in row 1 and nowhere in row 0: as eos, it ends row 1 first."""
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)[:, ids.shape[1]:]
    return next(token for token in plain[1, 2:].tolist() if token not in plain[0].tolist() and token > 2)


# --- a batch sized every step (draft/batch_sized.py) ---------------------------------------------------------
def flat_until(knee: int, seconds: float, sizes=(1, 2, 4, 8, 16, 32, 64, 128)) -> LatencyCurve:
    """A pass costs `seconds` up to `knee` tokens, then grows with the tokens (bound by arithmetic, not weights)."""
    return LatencyCurve(sizes, tuple(seconds * max(1.0, size / knee) for size in sizes))


def sized_batch(monkeypatch, profile: HardwareProfile, prior: list[float]) -> list:
    """Batches of this test size their steps with `profile` and `prior`, no timing corrections and no guard (what
    they choose depends on acceptance only), the plan lent to a chain being these; returns the list every sized
    drafter of the test is appended to."""
    from hf_specdec.integration import batch as batch_module
    from hf_specdec.integration import generate as integration
    from hf_specdec.plan.shape_sizing import RankAcceptance
    from hf_specdec.plan.step_sizing import StepSizer

    plan = SimpleNamespace(profile=profile, acceptance=prior)
    monkeypatch.setattr(integration, "plan_for_call", lambda *args, **kwargs: (plan, "curves given here"))
    monkeypatch.setattr(batch_module, "batch_guard", lambda *args: None)  # the sizing alone: no measured step
    monkeypatch.setattr(batch_module, "online_sizer", lambda profile, *args: StepSizer(profile, timing_memory=1.0))
    monkeypatch.setattr(batch_module, "RankAcceptance", RankAcceptance)
    return sized_batch_drafters(monkeypatch)


def sized_batch_drafters(monkeypatch) -> list:
    """Every `SizedLockstepDrafter` the test makes, appended as it is made."""
    from hf_specdec.draft import batch_sized

    drafters, made = [], batch_sized.SizedLockstepDrafter.__init__

    def kept(self, *args, **kwargs):
        made(self, *args, **kwargs)
        drafters.append(self)

    monkeypatch.setattr(batch_sized.SizedLockstepDrafter, "__init__", kept)
    return drafters


def hooked_chain_call(target, draft, ids: torch.Tensor, mask: torch.Tensor, hook) -> object:
    """A batch decoded by a 3-token chain, every step speculating, with `hook` (a handle on the draft) removed after;
    its rows checked identical to plain batched generate."""
    call = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    try:
        out = target.generate(ids, **call, assistant_model=draft, speculation="chain",
                              speculation_config=WHOLE_CHAIN_3, return_dict_in_generate=True)
    finally:
        hook.remove()
    assert torch.equal(out.sequences, target.generate(ids, **call))
    return out
