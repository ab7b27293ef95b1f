"""Every model family a user may bring: lossless speculation, or a clear refusal before anything runs.

The families are `tests.families.FAMILIES` (README's matrix is generated from the same list): tiny random
float32 models, sliding windows of 8 tokens that generation crosses many times, learned position tables that
generation runs to the end of. Supported families must be greedy token-identical to plain `generate` with every
tree method and really speculate (a draft equal to the target accepts whole paths); refused ones must raise with the
reason before touching the model, its generation config or Transformers. The sampling section enumerates one
verification step exactly on the families whose masks or positions differ from Llama's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, GenerationMixin
from transformers.generation.streamers import BaseStreamer

from hf_specdec.accept.kv_cache import full_length_cache, record_states
from hf_specdec.core.releases import ASSISTED_ON_RECURRENT_STATE, cache_arg, output_cache
from hf_specdec.core.tree import TokenTree
from hf_specdec.decoding.step import chain_pass
from hf_specdec.draft.draft_model import DraftModelRunner
from hf_specdec.plan.latency import measure_latency
from hf_specdec.runtime.attention import AttentionLayout
from hf_specdec.verify import SequoiaVerifier, TargetSampleVerifier
from hf_specdec_tools import families_cli
from tests.families import FAMILIES, POSITIONS, WINDOW, Family, family
from tests.helpers.exactness import speculative_joint, target_joint, total_variation
from tests.helpers.family_cases import (
    METHODS,
    NEW_TOKENS,
    PROMPT,
    TEMPERATURE,
    ModelCase,
    new_tokens,
    prompt,
    tiny,
)
from tests.helpers.plain_steps import guard_plain_at

SUPPORTED = [f for f in FAMILIES if f.supported]
REFUSED = [f for f in FAMILIES if not f.supported]
CHAINS = [f for f in REFUSED if f.chains]  # recurrent state: trees refused, `chain` rolls the state back


def names(families):
    return [f.name for f in families]


# --------------------------------------------------------------------------- supported: lossless and speculating


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("entry", SUPPORTED, ids=names(SUPPORTED))
def test_identical_to_plain_and_speculating(entry, method):
    target = tiny(entry.name)
    assert type(target).__name__ == entry.model
    ids, n = prompt(), new_tokens(entry)
    expected = target.generate(ids, do_sample=False, max_new_tokens=n)
    assert expected.shape[1] == PROMPT + n
    out = target.generate(ids, assistant_model=copy.deepcopy(target), speculation=method,
                          speculation_config=METHODS[method], do_sample=False, max_new_tokens=n,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    stats = out.speculation_stats
    assert stats.new_tokens == n and stats.target_forwards / n <= 0.5, stats.tokens_per_step


@pytest.mark.parametrize("entry", SUPPORTED, ids=names(SUPPORTED))
def test_identical_with_a_different_draft(entry):
    """Rejections at every depth: a differently seeded draft of the family, greedy, a wide tree."""
    target, draft = tiny(entry.name), tiny(entry.name, seed=1)
    ids, n = prompt(seed=1), new_tokens(entry)
    expected = target.generate(ids, do_sample=False, max_new_tokens=n)
    out = target.generate(ids, assistant_model=draft, speculation="tree", speculation_config={"widths": [3, 2, 2]},
                          do_sample=False, max_new_tokens=n)
    assert torch.equal(out, expected)


def test_layouts_of_the_sliding_families():
    """The mask rule reads Transformers' own layer types: mixed families get a dict of masks, others one."""
    for entry in SUPPORTED:
        layout = AttentionLayout.of(tiny(entry.name))
        assert (layout.window == WINDOW) == ("sliding" in entry.traits), entry.name
        assert (len(set(layout.layer_types)) > 1) == ("mixed" in entry.traits), entry.name
        assert layout.position_limit == entry.position_limit, entry.name


def test_a_cache_given_before_the_window_is_reached_is_used():
    """A user's cache still holding every row is converted in place; one past its window is refused up front."""
    target = tiny("Mistral (sliding window)")
    ids = prompt(12)
    expected = target.generate(ids, do_sample=False, max_new_tokens=30)
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(ids[:, :5], **cache_arg(cache), use_cache=True)
    out = target.generate(ids, **cache_arg(cache), assistant_model=target, speculation="tree", do_sample=False,
                          max_new_tokens=30, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected) and output_cache(out) is cache
    full = DynamicCache(config=target.config)
    with torch.no_grad():
        target(ids, **cache_arg(full), use_cache=True)
    rows = [layer.keys.shape[-2] for layer in full.layers]
    with pytest.raises(ValueError, match="dropped their oldest rows"):
        target.generate(ids, **cache_arg(full), assistant_model=target, speculation="tree", max_new_tokens=4)
    assert [layer.keys.shape[-2] for layer in full.layers] == rows


def test_full_length_cache_keeps_rows_and_the_object():
    target = tiny("Gemma 3 (text)")
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(prompt(5), **cache_arg(cache), use_cache=True)
    keys = [layer.keys.clone() for layer in cache.layers]
    assert full_length_cache(cache) is cache
    assert not any(layer.is_sliding for layer in cache.layers)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(keys, cache.layers))


@pytest.mark.parametrize("name", ["Mistral (sliding window)", "Gemma 3 (text)", "GPT-2"])
def test_draft_runner_logits_equal_causal_passes(name):
    """The draft's cache across passes (catch-up, tree slots, slots of an earlier pass, commit) past the window."""
    model = tiny(name)
    ids = prompt(3 * WINDOW)[0]

    def causal(tokens):
        with torch.no_grad():
            return model(torch.as_tensor(tokens)[None]).logits[0, -1]

    runner = DraftModelRunner(model)
    torch.testing.assert_close(runner.sync(ids[:-6]), causal(ids[:-6]), atol=1e-4, rtol=1e-4)
    tree = TokenTree.from_paths(int(ids[-1]), [(10,), (11,), (10, 12), (11, 13), (10, 12, 14)])
    root, logits = runner.forward_tree(tree.tokens[1:], tree.depths[1:], tree.ancestors[1:, 1:], ids)
    torch.testing.assert_close(root, causal(ids), atol=1e-4, rtol=1e-4)
    for node in range(1, len(tree)):
        path = tree.tokens[tree.path_to(node)[1:]]
        torch.testing.assert_close(logits[node - 1], causal(torch.cat([ids, path])), atol=1e-4, rtol=1e-4)
    sees = torch.zeros(2, runner.num_nodes + 2, dtype=torch.bool)
    sees[:, [0, 2, 4]] = True  # the slots of (10,), (10, 12), (10, 12, 14)
    sees[1, runner.num_nodes] = True
    _, more = runner.forward_tree(torch.tensor([15, 16]), torch.tensor([4, 5]), sees)
    deep = torch.cat([ids, torch.tensor([10, 12, 14, 15, 16])])
    torch.testing.assert_close(more[1], causal(deep), atol=1e-4, rtol=1e-4)
    runner.commit(deep[:-1], [0, 2, 4, 5])  # (10, 12, 14, 15) accepted
    torch.testing.assert_close(runner.sync(deep), causal(deep), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["Mistral (sliding window)", "Gemma 2", "GPT-2"])
def test_latency_timing_past_the_window_and_the_table(name):
    model = tiny(name)
    curve = measure_latency(model, sizes=(1, 4), past_length=64, repeats=1, progress=False, stop_ratio=None)
    assert curve.sizes == (1, 4) and curve.past_length == (POSITIONS - 2 if name == "GPT-2" else 64)


# --------------------------------------------------------------------------- learned positions: up to the end


class Collector(BaseStreamer):
    def __init__(self) -> None:
        self.tokens: list[int] = []

    def put(self, value):
        self.tokens += value.flatten().tolist()

    def end(self):
        pass


LEARNED = [f for f in SUPPORTED if "learned" in f.traits]  # GPT-J's fixed table raises other errors at its end


@pytest.mark.parametrize("entry", LEARNED, ids=names(LEARNED))
def test_past_the_last_position_fails_where_plain_generate_fails(entry):
    target = tiny(entry.name)
    ids = prompt()
    plain, ours = Collector(), Collector()
    too_many = new_tokens(entry) + 3
    with pytest.raises(IndexError):
        target.generate(ids, do_sample=False, max_new_tokens=too_many, streamer=plain)
    with pytest.raises(IndexError, match=f"at most max_length={POSITIONS + 1}"):
        target.generate(ids, assistant_model=target, speculation="tree", do_sample=False, max_new_tokens=too_many,
                        streamer=ours)
    assert ours.tokens == plain.tokens and len(plain.tokens) == POSITIONS + 1


@pytest.mark.parametrize("entry", LEARNED, ids=names(LEARNED))
def test_a_draft_with_a_shorter_position_table(entry):
    """The draft's positions run out first: it drafts from its last row on (weaker drafts), never crashes."""
    shorter = Family(entry.name, entry.model, entry.config, _shorter_table(entry.kwargs), entry.attn, entry.traits)
    target, draft = tiny(entry.name), shorter.build(seed=0)
    ids, n = prompt(), new_tokens(entry)
    expected = target.generate(ids, do_sample=False, max_new_tokens=n)
    for method in ("tree", "specexec"):
        out = target.generate(ids, assistant_model=draft, speculation=method, speculation_config=METHODS[method],
                              do_sample=False, max_new_tokens=n)
        assert torch.equal(out, expected)


def _shorter_table(kwargs: dict) -> dict:
    key = "n_positions" if "n_positions" in kwargs else "max_position_embeddings"
    return {**kwargs, key: POSITIONS // 2}


# --------------------------------------------------------------------------- refused: before anything changes


def _state(model) -> tuple:
    """What a refused call must leave alone: generation config, config, the model's attributes, Transformers."""
    return (copy.deepcopy(model.generation_config.to_dict()), model.config.to_dict(), sorted(vars(model)),
            GenerationMixin.generate)


@pytest.mark.parametrize("role", ["target", "assistant_model"])
@pytest.mark.parametrize("entry", REFUSED, ids=names(REFUSED))
def test_refused_up_front(entry, role):
    model, llama = tiny(entry.name), tiny("Llama")
    assert type(model).__name__ == entry.model
    target, draft = (model, llama) if role == "target" else (llama, model)
    before = (_state(target), _state(draft))
    with pytest.raises(ValueError, match=entry.refused) as error:
        target.generate(prompt(), assistant_model=draft, speculation="tree", max_new_tokens=4)
    assert (_state(target), _state(draft)) == before
    message = str(error.value)
    if not model.config.is_encoder_decoder:  # one sentence: the class, the family, the reason, the fix
        assert entry.model in message and role in message and "speculation=" in message
        assert message.count(". ") == 0 and message.endswith(".")
    if entry.chains:  # the fix names the method that runs on it, or the release that makes it run
        assert ("pass speculation='chain'" if ASSISTED_ON_RECURRENT_STATE else "transformers>=5.25") in message


# --------------------------------------------------------------------------- recurrent state: chains


def chain(target, ids, draft, n, **kwargs):
    return target.generate(ids, assistant_model=draft, speculation="chain", do_sample=False, max_new_tokens=n,
                           speculation_config={"num_draft_tokens": 5, "guard": False}, **kwargs)


@pytest.mark.parametrize("entry", CHAINS, ids=names(CHAINS))
def test_a_chain_rolls_a_recurrent_state_back(entry):
    """From Transformers 5.25 on, `chain` runs on a model with recurrent state, as target or draft: greedy identical
    to plain with the model itself as its draft (long accepted chains), another seed of it and an attention model
    (rejections at every depth), and a recurrent draft of an attention target. An older release refuses, naming the
    release that rolls the state back."""
    target, ids = tiny(entry.name), prompt()
    if not ASSISTED_ON_RECURRENT_STATE:
        with pytest.raises(ValueError, match=r"from 5\.25 on .*transformers>=5\.25"):
            chain(target, ids, target, 4)
        return
    expected = target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS)
    out = chain(target, ids, copy.deepcopy(target), NEW_TOKENS, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculation_stats.target_forwards / NEW_TOKENS <= 0.5, out.speculation_stats.tokens_per_step
    for draft in (tiny(entry.name, seed=1), tiny("Llama")):
        assert torch.equal(chain(target, ids, draft, NEW_TOKENS), expected)
    llama = tiny("Llama")
    assert torch.equal(chain(llama, ids, target, NEW_TOKENS), llama.generate(ids, do_sample=False,
                                                                              max_new_tokens=NEW_TOKENS))


PLAIN_AT = (0, 3, 4)  # the steps the guard makes plain in the next test: the call's first, and two in a row later
SPECULATING = SUPPORTED + (CHAINS if ASSISTED_ON_RECURRENT_STATE else [])  # a chain on recurrent state: 5.25 on


@pytest.mark.parametrize("entry", SPECULATING, ids=names(SPECULATING))
def test_a_plain_first_step_runs_no_target_pass(entry, monkeypatch):
    """A call whose first step is plain (a wait the guard carried over, a sized method's first choice) takes that
    token from the prompt's pass, as plain `generate` does, and runs no target pass for it: the prompt's pass wrote
    the root's row, which the cache keeps until a step runs a pass. A recurrent state is rolled back after the prompt's
    pass and pays the pass. Greedy identical to plain, the first token's logits plain's own, later plain steps one
    pass each."""
    guard_plain_at(monkeypatch, PLAIN_AT)
    target, ids, n = tiny(entry.name), prompt(), new_tokens(entry)
    expected = target.generate(ids, do_sample=False, max_new_tokens=n, output_logits=True,
                               return_dict_in_generate=True)
    draft, passes = copy.deepcopy(target), []
    hook = target.register_forward_pre_hook(lambda module, args: passes.append(1))
    try:
        out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=n,
                              speculation="chain" if entry in CHAINS else "tree", output_logits=True,
                              speculation_config={"num_draft_tokens": 4} if entry in CHAINS else {"widths": [2, 1, 1]},
                              return_dict_in_generate=True)  # fixed shapes: no latency curves measured
    finally:
        hook.remove()
    stats = out.speculation_stats
    assert torch.equal(out.sequences, expected.sequences)
    if entry not in CHAINS:  # recording a recurrent state's steps, Qwen3-Next's prompt pass differs in the last bits
        assert torch.equal(out.logits[0], expected.logits[0])  # the prompt's pass's own row
    for ours, plain in zip(out.logits, expected.logits, strict=True):  # tree passes: other shapes, last bits
        torch.testing.assert_close(ours, plain, rtol=0, atol=1e-4)
    steps = len(stats.tokens_per_step)
    assert stats.tokens_per_step[0] == 1 and stats.plain_steps == len(PLAIN_AT) and steps > max(PLAIN_AT)
    first_pass = entry in CHAINS  # the rolled-back state's first step runs its pass
    assert stats.target_forwards == steps - 1 + first_pass
    assert len(passes) == 1 + stats.target_forwards  # the prompt's pass and the steps'


def test_what_a_chain_on_recurrent_state_refuses():
    """Batches, static caches and a filled cache on a recurrent target: refused by name, before anything runs."""
    target = tiny("Mamba")
    cases = [
        (dict(input_ids=torch.cat([prompt(), prompt(seed=1)])), "batch"),
        (dict(input_ids=prompt(), cache_implementation="static"), "dynamic cache only"),
    ]
    if ASSISTED_ON_RECURRENT_STATE:
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(prompt(5), **cache_arg(cache), use_cache=True)
        cases.append((dict(input_ids=prompt(), **cache_arg(cache)), "starts from an empty cache"))
    for kwargs, message in cases:
        before = _state(target)
        with pytest.raises(ValueError, match=message if ASSISTED_ON_RECURRENT_STATE else "transformers>=5.25"):
            target.generate(assistant_model=target, speculation="chain", max_new_tokens=4, **kwargs)
        assert _state(target) == before


def test_refused_stage_model_of_a_staged_stack():
    target, mamba = tiny("Llama"), tiny("Mamba")
    with pytest.raises(ValueError, match=r"stages\[0\] MambaForCausalLM \(mamba\)"):
        target.generate(prompt(), assistant_model=target, speculation="staged",
                        speculation_config={"stages": [mamba, "ngram"]}, max_new_tokens=4)


# --------------------------------------------------------------------------- sampling: one step, enumerated exactly


class ChainModelCase(ModelCase):
    """`ModelCase` for a family with recurrent state: the drafted chain is scored by the chain pass after the context,
    on the model's own cache recording its states (what the loop runs)."""

    def tree_scores(self, tree) -> torch.Tensor:
        cache = DynamicCache(config=self.target.config)
        record_states(cache, len(tree))
        with torch.no_grad():
            self.target(self.context[None, :-1], **cache_arg(cache), use_cache=True)
            output = chain_pass(self.target, tree, cache, torch.device("cpu"))
        return output.logits[0].float() / TEMPERATURE


@pytest.mark.parametrize("verifier_cls", [SequoiaVerifier, TargetSampleVerifier])
@pytest.mark.parametrize("name", ["Mamba", "Jamba", "LFM2"])
def test_one_sampled_chain_step_on_recurrent_state_is_exact(name, verifier_cls):
    """One chain step enumerated exactly (before 5.25, where the state cannot roll back: a sampled call refused)."""
    if not ASSISTED_ON_RECURRENT_STATE:
        with pytest.raises(ValueError, match=r"transformers>=5\.25"):
            tiny(name).generate(prompt(), assistant_model=tiny(name), speculation="chain", do_sample=True,
                                max_new_tokens=4)
        return
    case = ChainModelCase(family(name), 12)
    got, accepted = speculative_joint(case, [[[]]], verifier_cls(), 3, build=case.build)  # a chain of two
    want = target_joint(case, case.prompt, 3)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert total_variation(got, want) < 1e-5
    assert accepted > 0.05


SAMPLING_FAMILIES = {
    "Mistral (sliding window)": 3 * WINDOW,  # one mask, keys far behind the window
    "Gemma 3 (text)": 3 * WINDOW,  # a dict of masks: full and sliding layers
    "GPT-2": POSITIONS - 2,  # the tree's deepest nodes sit at the table's last position
    "OPT": POSITIONS - 2,
}


@pytest.mark.parametrize("verifier_cls", [SequoiaVerifier, TargetSampleVerifier])
@pytest.mark.parametrize("name", SAMPLING_FAMILIES)
def test_one_sampled_step_is_exact(name, verifier_cls):
    case = ModelCase(family(name), SAMPLING_FAMILIES[name])
    spec = [[[]], []]  # two children, the first with a child: depth 2, siblings in the mask
    got, accepted = speculative_joint(case, spec, verifier_cls(), 3, build=case.build)
    want = target_joint(case, case.prompt, 3)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert total_variation(got, want) < 1e-5
    assert accepted > 0.05  # the draft's children are accepted often enough for the tree to matter


# --------------------------------------------------------------------------- README's matrix


def test_readme_matrix_is_generated_from_this_list():
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert families_cli.rewritten(text) == text, "run `hf-specdec families --readme README.md`"
    for entry in FAMILIES:
        assert f"| {entry.name} | `{entry.model}` |" in text


def test_families_command(tmp_path, capsys):
    from hf_specdec_tools.cli import main

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{families_cli.START}\nold\n{families_cli.END}\ntail\n")
    assert main(["families", "--readme", str(readme), "--check"]) == 1
    assert main(["families", "--readme", str(readme)]) == 0
    assert main(["families", "--readme", str(readme), "--check"]) == 0
    assert "| Gemma 2 |" in readme.read_text() and readme.read_text().endswith("tail\n")
    assert main(["families"]) == 0 and "| Mamba |" in capsys.readouterr().out
    assert main(["families", "--readme", str(tmp_path / "none.md")]) == 2
