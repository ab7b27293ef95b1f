"""The target's tree passes through the lean pass (`decoding.step.lean_target`): what plain `generate` gives, and
only where the pass needs nothing but the logits. Off the CPU the loop takes it by itself; here the `lean_target`
setting switches it on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_specdec import SequoiaConfig, SpecExecConfig
from hf_specdec.core.model_inputs import TokenInputs
from hf_specdec.core.releases import cache_arg
from hf_specdec.decoding import step
from hf_specdec.kernels.lean_pass import LeanPass
from hf_specdec.methods.sequoia.dp import plan_tree
from hf_specdec.runtime.attention import AttentionLayout
from hf_specdec.runtime.pass_shapes import PassShapes
from hf_specdec.runtime.ranks import Ranks
from tests.helpers.batches import kwargs_for, near_draft, padded_batch
from tests.helpers.lean import PAIRS  # Llama-shaped families, a sliding-window layer and one key/value head
from tests.helpers.methods import GREEDY  # the methods at fixed shapes
from tests.tiny import tiny_model

IDS = torch.tensor([[5, 9, 11, 4, 7, 3, 21, 8]])


@pytest.fixture
def lean_target_calls(monkeypatch) -> list[torch.Size]:
    """The (sequences, rows) of every lean target pass run (the tests switch it on with `lean_target=True`)."""
    calls: list[torch.Size] = []

    class Counted(LeanPass):
        def __call__(self, *args):
            calls.append(args[0].shape)
            return super().__call__(*args)

    monkeypatch.setattr(step, "LeanPass", Counted)
    return calls


@pytest.mark.parametrize("method", sorted(GREEDY))
@pytest.mark.parametrize("family", sorted(PAIRS))
@pytest.mark.parametrize("draft_seed", [0, 1])  # the target's own weights (long accepted paths), another model
def test_greedy_with_the_lean_target_pass_is_plain_generate(family, method, draft_seed, lean_target_calls):
    target = PAIRS[family]()
    draft = PAIRS[family]() if draft_seed == 0 else tiny_model("llama", draft_seed)
    plain = target.generate(IDS, do_sample=False, max_new_tokens=24)
    speculation = dataclasses.replace(GREEDY[method], lean_target=True)
    out = target.generate(IDS, assistant_model=draft, speculation=speculation, do_sample=False, max_new_tokens=24)
    assert torch.equal(out, plain)
    assert max(rows for _, rows in lean_target_calls) > 1  # the tree passes took it


#: fixed shapes, every step drafted (no timing-driven choice between calls): a draft-sampling and a target-sampling
#: verifier
FIXED = {"sequoia": SequoiaConfig(plan=plan_tree([0.6, 0.2, 0.1, 0.05], 32, 6), guard=False),
         "specexec": SpecExecConfig(budget=32, max_depth=6, width=4, guard=False)}


@pytest.mark.parametrize("method", sorted(FIXED))
def test_sampling_with_the_lean_target_pass_draws_what_the_forward_draws(method, monkeypatch):
    """Same seed, same tokens: in float32 the lean pass's logits differ from the forward's in their last bits at
    most, which moves a draw only when its uniform falls within that of a boundary."""
    target, draft = tiny_model("qwen2", 0), tiny_model("qwen2", 1)
    outs = []
    for lean in (True, False):
        torch.manual_seed(3)
        speculation = dataclasses.replace(FIXED[method], lean_target=lean)
        outs.append(target.generate(IDS, assistant_model=draft, speculation=speculation, do_sample=True,
                                    temperature=0.8, max_new_tokens=32))
    assert torch.equal(outs[0], outs[1])


def test_passes_that_need_more_than_logits_keep_the_forward(monkeypatch):
    target = tiny_model("qwen2", 0)
    layout = AttentionLayout.of(target)
    dynamic, static = PassShapes(None, set()), PassShapes(64, set())
    one = Ranks.of(target)

    def lean(model=target, shapes=dynamic, outputs=False, use=True):
        return step.lean_target(model, layout, copies=None, ranks=one, use=use, static=shapes.width is not None,
                                pass_outputs=outputs, token_inputs=TokenInputs())

    assert lean(use=None) is None  # a CPU: the forward by default
    forward = lean()
    assert forward is not None
    with pytest.raises(TypeError):  # an input the lean pass would not honour is never dropped
        forward(input_ids=IDS, attention_mask=None, position_ids=None, **cache_arg(None), output_attentions=True)
    assert lean(shapes=static) is None  # padded passes on a static cache
    assert lean(outputs=True) is None  # hidden states or attentions to return
    assert lean(model=_eager(tiny_model("qwen2", 0))) is None
    assert lean(use=False) is None


def _eager(model: torch.nn.Module) -> torch.nn.Module:
    model.config._attn_implementation = "eager"  # the user asked for eager attention: theirs
    return model


def test_hidden_states_asked_for_keep_the_forward(lean_target_calls):
    target, draft = tiny_model("qwen2", 0), tiny_model("qwen2", 1)
    plain = target.generate(IDS, do_sample=False, max_new_tokens=12)
    out = target.generate(IDS, assistant_model=draft, speculation="sequoia", speculation_config={"lean_target": True},
                          do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_hidden_states=True)
    assert torch.equal(out.sequences, plain) and lean_target_calls == []


@pytest.mark.parametrize("method", ["chain", "sequoia", "specexec"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_batch_with_the_lean_target_pass_is_plain_batched_generate_row_by_row(family, method, lean_target_calls):
    """Left-padded rows of different lengths, ragged acceptance: every row's tokens are plain batched generate's,
    and the batch's tree passes (b rows at once) took the lean pass. Every step speculates (no guard; `specexec`'s
    budget fixed): timings taken on a loaded machine must not turn the batch plain (a parallel run once did)."""
    target = tiny_model(family, 0)
    draft = near_draft(target)
    ids, mask = padded_batch(3, [0, 3, 5])
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    kwargs = kwargs_for(method, draft)
    kwargs["speculation_config"] = {**kwargs.get("speculation_config", {}), "lean_target": True, "guard": False,
                                    **({"budget": 16} if method == "specexec" else {})}
    out = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, **kwargs)
    assert torch.equal(out, plain)
    assert any(sequences == 3 and rows > 1 for sequences, rows in lean_target_calls)
