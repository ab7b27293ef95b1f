"""`speculation="staged"`: drafter stacks (draft model <- cheaper stages) stay lossless and really save draft passes."""

from __future__ import annotations

import copy
import json
import pickle
from collections import Counter

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_specdec import NGramModel, NGramModelDrafter, StagedConfig, TokenTree
from hf_specdec.core.verdict import Verdict
from hf_specdec.draft.draft_model import DraftModelRunner
from hf_specdec.logits.processing import process_tree_scores
from hf_specdec.methods.specexec.best_first import BestFirstDrafter
from hf_specdec.runtime.model_info import MAX_PADDING_ROWS
from hf_specdec.verify import TargetSampleVerifier
from tests.conftest import VOCAB, random_prompt, tiny_model
from tests.helpers.exactness import all_runs, chi_square_pvalue, total_variation


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and the machine is shared: oversubscribed threads are 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trio(tiny_pair):
    """(target, draft, smaller draft) of one architecture."""
    target, draft = tiny_pair
    return target, draft, tiny_model(target.config.model_type, 2)


@pytest.fixture(scope="module")
def lm_file(tmp_path_factory, trio):
    """A trigram model trained on the draft's own samples, saved as JSON."""
    target, draft, _ = trio
    prompts = [random_prompt(torch.Generator().manual_seed(s), 6) for s in range(6)]
    model = NGramModel.from_model_samples(draft, prompts, max_new_tokens=48, order=3)
    path = tmp_path_factory.mktemp("ngram") / "lm.json"
    model.save(path)
    return path


def _stacks(trio, lm_file):
    """(name, assistant, stages): the draft alone, the default stack, an n-gram LM, three-level stacks, and stacks
    whose draft is the target itself (everything accepted: deep trees, confirmations and commits get exercised)."""
    target, draft, small = trio
    return [
        ("default", draft, None),
        ("alone", draft, []),
        ("ngram-model+lookup", draft, [["ngram", {"ngram_model": str(lm_file)}]]),
        ("three-level", draft, [{"model": small, "budget": 6}, "ngram"]),
        ("perfect-draft", target, ["ngram"]),
        ("perfect-three-level", target, [target, {"ngram_model": str(lm_file), "width": 3}]),
    ]


def _plain(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


def _staged(target, assistant, ids, stages, budget=None, **kwargs):
    """`budget`: a fixed tree size (trees sized every step follow measured timings: counts vary from run to run)."""
    settings = ({} if stages is None else {"stages": stages}) | ({} if budget is None else {"budget": budget})
    return target.generate(ids, assistant_model=assistant, speculation="staged", speculation_config=settings,
                           do_sample=False, **kwargs)


def test_greedy_identical_to_plain(trio, lm_file):
    target = trio[0]
    generator = torch.Generator().manual_seed(0)
    prompts = [random_prompt(generator, 3 + 5 * trial) for trial in range(4)]
    expected = [_plain(target, ids, max_new_tokens=24) for ids in prompts]
    for name, assistant, stages in _stacks(trio, lm_file):
        for ids, want in zip(prompts, expected):
            assert torch.equal(_staged(target, assistant, ids, stages, max_new_tokens=24), want), name


@pytest.mark.parametrize("processor_kwargs", [{"repetition_penalty": 1.8}, {"no_repeat_ngram_size": 2}])
def test_greedy_identical_with_processors(trio, lm_file, processor_kwargs):
    target = trio[0]
    generator = torch.Generator().manual_seed(5)
    for trial in range(2):
        ids = random_prompt(generator, 4 + 6 * trial)
        want = _plain(target, ids, max_new_tokens=20, **processor_kwargs)
        for name, assistant, stages in _stacks(trio, lm_file)[2:]:
            got = _staged(target, assistant, ids, stages, max_new_tokens=20, **processor_kwargs)
            assert torch.equal(got, want), name


@pytest.mark.parametrize("new_tokens", [1, 2, 5, 13])
def test_max_new_tokens_inside_a_block(trio, new_tokens):
    target = trio[0]
    ids = random_prompt(torch.Generator().manual_seed(3), 5)
    out = _staged(target, target, ids, [target, "ngram"], budget=32, max_new_tokens=new_tokens,
                  return_dict_in_generate=True)
    assert torch.equal(out.sequences, _plain(target, ids, max_new_tokens=new_tokens))
    assert out.speculation_stats.target_forwards <= (new_tokens + 2) // 3  # blocks of >= 3 tokens, cut inside one


def _repeating_prompt(target) -> torch.Tensor:
    """A prompt whose greedy continuation repeats text already in the context (tiny models fall into loops)."""
    generator = torch.Generator().manual_seed(11)
    for _ in range(50):
        ids = random_prompt(generator, 8).repeat(1, 3)
        out = _plain(target, ids, max_new_tokens=48)[0, -24:].tolist()
        if len(set(out)) <= 8:
            return ids
    raise AssertionError("no looping prompt found")


def test_lower_stage_saves_draft_passes_on_repetitive_text(trio):
    """The n-gram stage lets one draft pass confirm several levels: fewer draft passes per generated token.

    The target is sharpened so the draft (the target itself) is confident, as real models are on repeated text. The
    budget is fixed: trees sized every step follow measured timings, and their pass counts vary from run to run.
    """
    target = copy.deepcopy(trio[0])
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    ids = _repeating_prompt(target)
    want = _plain(target, ids, max_new_tokens=48)
    passes = {}
    for name, stages in [("alone", []), ("ngram", ["ngram"])]:
        out = _staged(target, target, ids, stages, budget=32, max_new_tokens=48, return_dict_in_generate=True)
        assert torch.equal(out.sequences, want)
        passes[name] = out.speculation_stats.draft_forwards / out.speculation_stats.new_tokens
    assert passes["ngram"] < 0.7 * passes["alone"], passes


def test_confirmed_nodes_carry_the_logits_of_their_path(trio):
    """Logits from one pass that syncs the cache and forwards a lower tree equal a plain causal run per path."""
    target = trio[0]
    ids = random_prompt(torch.Generator().manual_seed(4), 9)
    runner = DraftModelRunner(target)
    runner.sync(ids[0, :5])
    runner.forward_tree(torch.tensor([7, 8]), torch.tensor([1, 1]), torch.zeros(2, 2, dtype=torch.bool))
    tree = TokenTree.from_paths(int(ids[0, -1]), [(10,), (11,), (10, 12), (10, 13), (10, 12, 14)])
    sees = tree.ancestors[1:, 1:]
    root_logits, logits = runner.forward_tree(tree.tokens[1:], tree.depths[1:], sees, ids[0])
    with torch.no_grad():
        full = target(ids).logits[0, -1]
        torch.testing.assert_close(root_logits, full, atol=1e-4, rtol=1e-4)
        for node in range(1, len(tree)):
            path = tree.tokens[tree.path_to(node)[1:]]
            causal = target(torch.cat([ids[0], path])[None]).logits[0, -1]
            torch.testing.assert_close(logits[node - 1], causal, atol=1e-4, rtol=1e-4)
    # A second pass seeing earlier slots and in-pass ancestors: a child of node (10, 12, 14) and its child.
    slot = 4  # (10, 12, 14) is the 5th forwarded node
    sees = torch.zeros(2, runner.num_nodes + 2, dtype=torch.bool)
    sees[:, [0, 2, slot]] = True
    sees[1, runner.num_nodes] = True
    _, more = runner.forward_tree(torch.tensor([15, 16]), torch.tensor([4, 5]), sees)
    with torch.no_grad():
        causal = target(torch.cat([ids[0], torch.tensor([10, 12, 14, 15, 16])])[None]).logits[0, -2:]
    torch.testing.assert_close(more, causal, atol=1e-4, rtol=1e-4)


def test_trees_are_valid_and_within_limits(trio, lm_file):
    target, draft, small = trio
    lower = BestFirstDrafter(small, lower=NGramModelDrafter(NGramModel.load(lm_file)), budget=6, max_depth=10, width=4,
                             beams=4, max_passes=1)
    drafter = BestFirstDrafter(draft, lower=lower, budget=20, max_depth=5, width=3, beams=3, max_passes=3)
    generator = torch.Generator().manual_seed(8)
    ids = random_prompt(generator, 10)
    for _ in range(6):
        tree = drafter.propose(ids)
        parents, depths = tree.parents.tolist(), tree.depths.tolist()
        assert 2 <= len(tree) <= 20 and max(depths) <= 5 and int(tree.tokens[0]) == int(ids[0, -1])
        assert depths == sorted(depths)  # breadth-first
        seen = set()
        for i in range(1, len(tree)):  # siblings contiguous
            assert parents[i] == parents[i - 1] or parents[i] not in seen
            seen.add(parents[i])
        for parent in set(parents[1:]):  # no duplicate siblings
            kids = tree.tokens[tree.children(parent)].tolist()
            assert len(kids) == len(set(kids))
        path = [0]
        while len(kids := tree.children(path[-1])) and len(path) < 3:
            path.append(int(kids[0]))
        drafter.accept(torch.cat([ids, tree.tokens[path[1:]][None], torch.tensor([[5]])], dim=1), tree,
                       Verdict(path=path, bonus_token=5, accepted_ranks=[0] * (len(path) - 1)))
        ids = torch.cat([ids, tree.tokens[path[1:]][None], torch.tensor([[5]])], dim=1)
        assert len(drafter.runner.committed) <= ids.shape[1]


def test_ngram_model_round_trip(tmp_path):
    generator = torch.Generator().manual_seed(0)
    corpus = [torch.randint(3, 20, (200,), generator=generator).tolist() + [5, 6, 7, 8] * 20 for _ in range(5)]
    model = NGramModel.train(corpus, order=3, min_count=1, top_k=6)
    path = tmp_path / "lm.json"
    model.save(path)
    raw = path.read_bytes()
    assert raw.startswith(b"{") and json.loads(raw)["format"] == "hf_specdec.ngram_model"
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(raw)
    loaded = NGramModel.load(path)
    contexts = [[5, 6], [6, 7], [3, 4], [19, 19], [99, 98], []]
    for ctx in contexts:
        assert loaded.next_tokens(ctx) == model.next_tokens(ctx)
        # Katz backoff is a distribution: it sums to one over the vocabulary, for seen and unseen contexts.
        assert sum(loaded.prob(t, ctx) for t in range(VOCAB)) == pytest.approx(1.0, abs=1e-9)
    assert loaded.next_tokens([5, 6])[0][0] == 7 and loaded.prob(7, [5, 6]) > 0.9
    drafter, reloaded = NGramModelDrafter(model), NGramModelDrafter(loaded)
    for ctx in ([1, 5, 6], [4, 19, 3], [2, 7, 8, 5]):
        ids = torch.tensor([ctx])
        a, b = drafter.propose(ids), reloaded.propose(ids)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    chain = drafter.propose(torch.tensor([[1, 5, 6]]))
    assert chain.tokens[chain.path_to(len(chain) - 1)].tolist()[:4] == [6, 7, 8, 5]


def test_ngram_train_command(tmp_path, capsys):
    from hf_specdec_tools.cli import main

    ids = tmp_path / "ids.jsonl"
    ids.write_text("\n".join(json.dumps([5, 6, 7, 8] * 10 + [i]) for i in range(3, 9)))
    out = tmp_path / "lm.json"
    assert main(["ngram", "train", "--ids", str(ids), "--min-count", "1", "--output", str(out)]) == 0
    assert "order 3" in capsys.readouterr().out
    assert NGramModel.load(out).next_tokens([5, 6])[0][0] == 7
    assert main(["ngram", "train", "--output", str(out)]) == 2
    assert "give a corpus" in capsys.readouterr().err


def test_ngram_model_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="hf-specdec ngram train"):
        NGramModel.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not an n-gram model file"):
        NGramModel.load(bad)
    bad.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="not an n-gram model file"):
        NGramModel.load(bad)


@pytest.mark.parametrize(
    "stages,message",
    [
        (["ngramm"], "unknown stage 'ngramm'; the only stage named by a string is 'prompt_lookup' \\(alias 'ngram'\\)"),
        ([{"prompt_lookup": {"depth": 0}}], "depth must be a positive integer"),
        ([{"prompt_lookup": {}, "ngram": {}}], "exactly one of the keys"),
        (["lm.json"], "ngram_model"),
        (["ngram", "ngram"], "put n-gram stages last"),
        ([{"ngram_model": "nowhere.json"}], "hf-specdec ngram train"),
        ([{"ngram": {"depth": 0}}], "depth must be a positive integer"),
        ([{"ngram": {}, "ngram_model": "x.json"}], "exactly one of the keys"),
        ([{"model": "Qwen/Qwen2.5-0.5B"}], "causal LM object"),
        ([{"ngram": {"max_ngramm": 3}}], "has no setting"),
        ([[]], "empty merged stage"),
        ([3.5], "cannot use a float"),
    ],
)
def test_bad_stacks_are_clear_errors(trio, stages, message):
    target, draft, _ = trio
    with pytest.raises(ValueError, match=message):
        _staged(target, draft, random_prompt(torch.Generator().manual_seed(0), 4), stages, max_new_tokens=2)


def test_prompt_lookup_stage_and_its_older_name_ngram_draft_alike(trio):
    """The stage is named `prompt_lookup` (as the method is); `ngram`, its older name, builds the same stage."""
    from hf_specdec.methods.prompt_lookup.drafter import PromptLookupDrafter
    from hf_specdec.methods.staged.stack import DEFAULT_STAGES, build_stack

    target, draft, _ = trio
    ids = random_prompt(torch.Generator().manual_seed(3), 12).repeat(1, 2)  # repeats: the lookup finds matches
    outs = [_staged(target, draft, ids, stages, max_new_tokens=16)
            for stages in (["prompt_lookup"], ["ngram"], [{"prompt_lookup": {"depth": 4}}], [{"ngram": {"depth": 4}}])]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])
    assert DEFAULT_STAGES == ("prompt_lookup",)
    assert isinstance(build_stack([{"ngram": {"depth": 4}}], target, None), PromptLookupDrafter)


def test_the_default_lookup_stage_continues_two_token_matches_only(trio):
    """Under the draft, a lookup continues only where the last two tokens recur: a one-token match (any common token
    of a long prompt) would hang a continuation off nearly every node, which the draft forwards and rarely confirms.
    `min_ngram=1` asks for one-token matches."""
    from hf_specdec.methods.staged.stack import build_stack

    target = trio[0]
    stage = build_stack(None, target, None)
    one_token = [5, 7, 9, 5, 8, 11, 5]  # 5 recurs, (11, 5) does not
    two_tokens = [5, 7, 9, 11, 12, 5, 7]  # (5, 7) recurs: continued with 9, 11, ...
    assert len(stage.propose_ids(one_token)) == 1
    tree = stage.propose_ids(two_tokens).host(tokens=True)
    assert tree.tokens[:3] == [7, 9, 11]
    assert len(build_stack([{"prompt_lookup": {"min_ngram": 1}}], target, None).propose_ids(one_token)) > 1


def test_model_in_merged_stage_and_wrong_vocab_are_errors(trio):
    target, draft, small = trio
    ids = random_prompt(torch.Generator().manual_seed(0), 4)
    with pytest.raises(ValueError, match="merged stage can only hold n-gram"):
        _staged(target, draft, ids, [[small, "ngram"]], max_new_tokens=2)
    other = tiny_model(target.config.model_type, 3)
    other.resize_token_embeddings(VOCAB + MAX_PADDING_ROWS + 1)  # more than padding apart (tests/test_vocab_padding.py)
    with pytest.raises(ValueError, match=r"stages\[0\]: this model's vocabulary"):
        _staged(target, draft, ids, [other], max_new_tokens=2)
    with pytest.raises(ValueError, match="assistant_model"):
        target.generate(ids, speculation="staged", max_new_tokens=2)
    with pytest.raises(ValueError, match="deterministic tree"):
        target.generate(ids, assistant_model=draft, speculation="staged", speculation_config={"verifier": "sequoia"},
                        do_sample=True, max_new_tokens=2)
    assert StagedConfig().default_sampling_verifier == "target_sample"


def _processed_dist(target, processors, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return processors(ids, target(ids).logits[:, -1].float()).double().softmax(-1)[0]


def _exact_two_tokens(target, processors, prompt: torch.Tensor) -> dict[tuple[int, int], float]:
    """P(first two sampled tokens) under plain sampling, prefix by prefix."""
    first = _processed_dist(target, processors, prompt)
    return {(a, b): float(first[a] * p) for a in torch.nonzero(first).flatten().tolist()
            for b, p in enumerate(_processed_dist(target, processors, torch.cat([prompt, torch.tensor([[a]])], 1)))
            if p > 0}


SAMPLING = {"temperature": 1.5, "top_k": 4, "repetition_penalty": 1.2}


def _sampling_processors() -> LogitsProcessorList:
    """What plain `generate` applies for SAMPLING, in its order."""
    return LogitsProcessorList([RepetitionPenaltyLogitsProcessor(SAMPLING["repetition_penalty"]),
                                TemperatureLogitsWarper(SAMPLING["temperature"]), TopKLogitsWarper(SAMPLING["top_k"])])


def test_one_sampled_step_is_exact(trio, lm_file):
    """Enumerate every random decision of one verification step of a three-level stack's real tree (the verifier's
    own draws, then target samples up to two tokens): exactly the target's processed two-token distribution."""
    target, draft, small = trio
    processors = _sampling_processors()
    prompt = random_prompt(torch.Generator().manual_seed(12), 10)
    config = StagedConfig(stages=[{"model": small, "budget": 6}, ["ngram", {"ngram_model": str(lm_file)}]], budget=12)
    verifier = TargetSampleVerifier()
    drafter = config.make_drafter(target, draft, processors, verifier.child_selection, None)
    tree = drafter.propose(prompt)
    assert len(tree) > 4
    with torch.no_grad():  # each node's target logits from a plain causal run over its own path
        logits = torch.stack([target(torch.cat([prompt[0], tree.tokens[tree.path_to(i)[1:]]])[None]).logits[0, -1]
                              for i in range(len(tree))])
    scores = process_tree_scores(processors, prompt[:, :-1], tree, logits)
    got = Counter()
    tokens = tree.tokens.tolist()
    for prob, verdict in all_runs(lambda src: verifier.verify(tree, scores, source=src)):
        emitted = [tokens[i] for i in verdict.path[1:]] + [verdict.bonus_token]
        if len(emitted) >= 2:
            got[tuple(emitted[:2])] += prob
        else:
            after = _processed_dist(target, processors, torch.cat([prompt, torch.tensor([emitted])], 1))
            for b, p in enumerate(after.tolist()):
                got[(emitted[0], b)] += prob * p
    want = _exact_two_tokens(target, processors, prompt)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert total_variation(got, want) < 1e-6


def test_sampling_through_generate_matches_plain_sampling():
    """End to end, chi-square: `generate(do_sample=True, speculation="staged")` with an n-gram LM stage, on a model
    with an 8-token vocabulary (few outcomes, so few samples suffice)."""
    target = tiny_model("llama", 0, sharpen=6.0, vocab_size=8, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    draft = copy.deepcopy(target)  # close to the target, not equal: accepts often, rejects sometimes
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn_like(draft.lm_head.weight) * 1.5)
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3]])
    lm = NGramModel.train([torch.randint(3, 8, (300,)).tolist()])
    exact = _exact_two_tokens(target, _sampling_processors(), prompt)
    counts, n, accepted = Counter(), 400, 0  # at 250 draws an exact sampler's TV is often 0.1 by chance
    for _ in range(n):
        out = target.generate(prompt, assistant_model=draft, speculation="staged", do_sample=True, max_new_tokens=2,
                              speculation_config={"stages": [["ngram", lm]], "budget": 6}, return_dict_in_generate=True,
                              **SAMPLING)
        counts[tuple(out.sequences[0, prompt.shape[1] :].tolist())] += 1
        accepted += out.speculation_stats.target_forwards == 1
    assert chi_square_pvalue(counts, exact, n) > 1e-3
    assert total_variation({k: c / n for k, c in counts.items()}, exact) < 0.1
    assert accepted > n // 10  # drafted tokens were accepted: speculation happened


def test_ngram_continuations_on_the_host_list_match_every_recurring_ngram():
    """Prompt lookup on the host list: for n from max_ngram down, the `depth` tokens after each earlier occurrence of
    the last n tokens, most recent first, at most `max_matches` per n (checked against a direct scan)."""
    from hf_specdec.methods.prompt_lookup.drafter import PromptLookupDrafter

    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        drafter = PromptLookupDrafter(max_ngram=1 + trial % 4, depth=1 + trial % 7, max_matches=1 + trial % 5)
        ids = torch.randint(0, 4, (int(torch.randint(1, 40, (1,), generator=generator)),), generator=generator).tolist()
        want = []
        for n in range(min(drafter.max_ngram, len(ids) - 1), 0, -1):
            starts = [s for s in range(len(ids) - n - 1, -1, -1) if ids[s : s + n] == ids[-n:]]
            want += [ids[s + n : s + n + drafter.depth] for s in starts[: drafter.max_matches]]
        assert drafter.continuations(ids) == want
    tree = drafter.propose(torch.tensor([[5, 6, 7, 5, 6]]))
    assert tree.host(tokens=True).tokens[:2] == [6, 7]  # "5 6" was followed by 7
