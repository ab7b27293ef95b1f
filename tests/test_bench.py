"""`hf-specdec bench` on tiny random models: strategy parsing, the raw-number schema, forward-pass counts,
losslessness of every strategy, the report files and the README region. Nothing here asserts on speed."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from hf_specdec import SPECULATION_METHODS
from hf_specdec.core.config import SpeculationConfig
from hf_specdec.methods.prompt_lookup import NGramConfig
from hf_specdec_tools.bench import BenchSettings, StrategyError, parse_strategy, resolve_strategies, run_benchmark
from hf_specdec_tools.bench.aggregate import summarize
from hf_specdec_tools.bench.cli import SCHEMA
from hf_specdec_tools.bench.inputs import PromptError, load_prompt_source, tokenize_prompts
from hf_specdec_tools.bench.loading import load_models
from hf_specdec_tools.bench.measure import ForwardCounter
from hf_specdec_tools.bench.readme import END, SECTION, START, ReadmeError, replace_region, update_readme
from hf_specdec_tools.bench.report import PLOTS, RESULTS_MD, budget_sweeps, load_json, settings_line, write_report
from hf_specdec_tools.bench.strategies import BASELINES, default_strategies, known_strategies, quick_strategies
from tests.conftest import random_prompt, tiny_model
from tests.tiny import tiny_tokenizer

NEW = 8
CALL_KEYS = {
    "prompt", "repeat", "strategy", "prompt_tokens", "new_tokens", "seconds", "tokens_per_s", "identical",
    "target_passes", "target_prefill_passes", "target_steps", "tokens_per_target_step", "draft_passes",
    "draft_passes_per_token", "rss_before_bytes", "peak_rss_delta_bytes", "speculation_stats",
}


@pytest.fixture(scope="module")
def run(llama_pair):
    """Every default strategy (the whole registry) on two prompts, greedy."""
    generator = torch.Generator().manual_seed(0)
    prompts = [random_prompt(generator, 10), random_prompt(generator, 14)]
    strategies = resolve_strategies(None)
    settings = BenchSettings(max_new_tokens=NEW, warmup=1, warmup_tokens=2)
    results = run_benchmark(*llama_pair, prompts, strategies, settings, progress=False)
    return results, strategies


# --- strategies -------------------------------------------------------------------------------------------------


def test_parse_method_settings_become_speculation_config(llama_pair):
    draft = llama_pair[1]
    strategy = parse_strategy("specexec:budget=128,width=4")
    assert strategy.settings == {"budget": 128, "width": 4}
    assert strategy.label == "specexec:budget=128,width=4"
    assert strategy.generate_kwargs(draft) == {
        "assistant_model": draft, "speculation": "specexec", "speculation_config": {"budget": 128, "width": 4}
    }
    tree = parse_strategy("tree:widths=[4,2,1]")
    assert tree.settings == {"widths": [4, 2, 1]} and tree.label == "tree:widths=[4,2,1]"
    assert parse_strategy("tree: widths = [4, 2, 1] ").settings == {"widths": [4, 2, 1]}
    assert parse_strategy("chain:verifier=greedy").settings == {"verifier": "greedy"}  # not JSON: kept as text


def test_parse_baselines(llama_pair):
    draft = llama_pair[1]
    assert parse_strategy("plain").generate_kwargs(draft) == {}
    assert parse_strategy("hf-assisted").generate_kwargs(draft) == {"assistant_model": draft}
    assert parse_strategy("hf-prompt-lookup").generate_kwargs(draft) == {"prompt_lookup_num_tokens": 10}
    custom = parse_strategy("hf-assisted:num_assistant_tokens=8,num_assistant_tokens_schedule=constant")
    assert custom.generate_kwargs(draft) == {
        "assistant_model": draft, "num_assistant_tokens": 8, "num_assistant_tokens_schedule": "constant"
    }


def test_method_without_assistant_gets_none(llama_pair):
    assert not NGramConfig.needs_assistant
    kwargs = parse_strategy("prompt_lookup").generate_kwargs(llama_pair[1])
    assert kwargs == {"speculation": "prompt_lookup"} and "assistant_model" not in kwargs
    assert parse_strategy("ngram").generate_kwargs(llama_pair[1]) == kwargs  # the older name is an alias
    assert "ngram" not in known_strategies()  # listed once, under its own name


def test_unknown_strategy_lists_the_known_ones():
    with pytest.raises(StrategyError) as error:
        parse_strategy("medusa:heads=4")
    message = str(error.value)
    assert "'medusa'" in message
    for name in ["plain", "hf-assisted", "hf-prompt-lookup", *SPECULATION_METHODS]:
        assert name in message


@pytest.mark.parametrize(
    "spec, words",
    [
        ("tree:widths", ["key=value", "widths"]),
        ("tree:=3", ["key=value"]),
        ("specexec:budget=", ["key=value"]),
        ("specexec:nope=1", ["nope", "budget"]),  # the method's own settings are listed
        ("specexec:budget=1", ["budget", "2"]),  # the method's validate()
        ("tree:widths=[4,2],widths=[1]", ["twice"]),
        ("plain:max_new_tokens=4", ["plain", "no settings"]),
        ("hf-assisted:bogus=1", ["bogus", "generation settings"]),
    ],
)
def test_bad_settings_say_what_and_how(spec, words):
    with pytest.raises(StrategyError) as error:
        parse_strategy(spec)
    for word in words:
        assert word in str(error.value)


def test_resolve_puts_plain_first_and_refuses_duplicates():
    assert [s.label for s in resolve_strategies(["tree", "chain"])] == ["plain", "tree", "chain"]
    assert [s.label for s in resolve_strategies(["tree", "plain"])] == ["plain", "tree"]
    with pytest.raises(StrategyError, match="twice"):
        resolve_strategies(["tree:widths=[2]", "tree:widths=[2]"])


@dataclass
class _LateConfig(SpeculationConfig):
    """Stands for a method registered after hf_specdec_tools.bench was written (sequoia, staged, ...)."""

    method = "sequoia"
    needs_assistant = False


def test_strategies_come_from_the_registry_at_run_time(monkeypatch, llama_pair):
    monkeypatch.setitem(SPECULATION_METHODS, "sequoia", _LateConfig)
    assert "sequoia" in known_strategies()
    assert "sequoia" in [s.name for s in default_strategies()]
    assert "sequoia" in [s.name for s in quick_strategies()]
    assert "assistant_model" not in parse_strategy("sequoia").generate_kwargs(llama_pair[1])
    monkeypatch.delitem(SPECULATION_METHODS, "sequoia")
    assert "sequoia" not in known_strategies() and "sequoia" not in [s.name for s in quick_strategies()]


# --- runner -----------------------------------------------------------------------------------------------------


def test_results_hold_every_raw_number(run):
    results, strategies = run
    assert set(results) >= {"settings", "strategies", "calls", "summary", "interrupted"}
    assert results["interrupted"] is False
    assert results["settings"]["max_new_tokens"] == NEW
    assert [s["label"] for s in results["strategies"]] == [s.label for s in strategies]
    assert len(results["calls"]) == 2 * len(strategies)
    for call in results["calls"]:
        assert set(call) == CALL_KEYS
        assert call["new_tokens"] == NEW and call["seconds"] > 0
    json.dumps(results)  # JSON-serialisable as is


def test_greedy_output_identical_for_every_strategy(run):
    results, strategies = run
    assert all(call["identical"] is True for call in results["calls"])
    assert {row["strategy"]: row["identical_text"] for row in results["summary"]} == {
        s.label: "2/2" for s in strategies
    }


def test_forward_counts_are_consistent(run):
    results, _ = run
    for call in results["calls"]:
        stats = call["speculation_stats"]
        assert call["target_passes"] == call["target_prefill_passes"] + call["target_steps"]
        assert call["tokens_per_target_step"] == pytest.approx(call["new_tokens"] / call["target_steps"])
        if call["strategy"] == "plain":
            assert call["target_passes"] == call["new_tokens"] and call["draft_passes"] == 0
            assert call["tokens_per_target_step"] == 1.0
        elif call["strategy"] == "hf-prompt-lookup":
            assert call["draft_passes"] == 0 and call["target_passes"] <= call["new_tokens"]
        elif call["strategy"] in ("hf-assisted", "hf-assisted-static"):
            assert call["draft_passes"] > 0 and call["target_prefill_passes"] == 0
        if stats is None:
            assert call["strategy"] in BASELINES
            continue
        # hooks and the engine's own counters agree; the prompt prefill is the only non-step pass
        assert call["target_steps"] == stats["target_forwards"]
        assert call["target_prefill_passes"] in (0, 1)
        assert call["draft_passes"] == stats["draft_forwards"]
        if not SPECULATION_METHODS[call["strategy"].split(":")[0]].needs_assistant:
            assert call["draft_passes"] == 0
        for name in ("time_total", "time_engine", "time_target_forward", "time_draft_forward"):
            assert stats[name] is not None and stats[name] >= 0


def test_summary_is_relative_to_plain(run):
    results, _ = run
    rows = {row["strategy"]: row for row in results["summary"]}
    assert rows["plain"]["speedup"]["median"] == pytest.approx(1.0)
    assert rows["plain"]["tokens_per_target_step"] == 1.0
    for row in results["summary"]:
        assert len(row["speedups"]) == 2
        assert row["speedup"]["min"] <= row["speedup"]["q1"] <= row["speedup"]["median"] <= row["speedup"]["max"]
        assert (row["kind"] == "hf_specdec") == bool(row["time_split"])
        if row["time_split"]:
            assert row["time_split"]["engine_ms_per_step"] >= 0
            assert 0 <= row["time_split"]["frac_engine"] <= 1


def test_sampling_reports_identity_as_not_applicable(llama_pair):
    prompt = [random_prompt(torch.Generator().manual_seed(3), 8)]
    settings = BenchSettings(max_new_tokens=4, temperature=0.8, warmup=0)
    results = run_benchmark(*llama_pair, prompt, resolve_strategies(["chain"]), settings, progress=False)
    assert all(call["identical"] is None for call in results["calls"])
    assert all(row["identical_text"].startswith("n/a") for row in results["summary"])
    again = run_benchmark(*llama_pair, prompt, resolve_strategies(["chain"]), settings, progress=False)
    assert [c["new_tokens"] for c in again["calls"]] == [c["new_tokens"] for c in results["calls"]]


def test_interrupted_run_keeps_the_prompts_every_strategy_finished(llama_pair, monkeypatch):
    from hf_specdec_tools.bench import runner

    real, calls = runner.measure_call, []

    def stopped_on_the_fourth_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "measure_call", stopped_on_the_fourth_call)
    prompts = [torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9]]), torch.tensor([[10, 11]])]
    settings = BenchSettings(max_new_tokens=3, warmup=0)
    results = run_benchmark(*llama_pair, prompts, resolve_strategies(["ngram"]), settings, progress=False)
    assert results["interrupted"] and [c["prompt"] for c in results["calls"]] == [0, 0]
    assert [row["prompts"] for row in results["summary"]] == [1, 1]


def test_time_limit_stops_before_a_prompt_that_would_overrun(llama_pair, monkeypatch):
    """Each round (one prompt, every strategy) takes 10 fake seconds: with 25 s allowed, a third round would end at
    30 s, so two prompts are measured, none is cut in half, and the report says why the rest are missing."""
    from hf_specdec_tools.bench import runner

    clock = {"now": 0.0}
    real = runner.measure_call

    def ten_seconds_per_round(*args, **kwargs):
        clock["now"] += 5.0  # two strategies (plain, ngram) per round
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "measure_call", ten_seconds_per_round)
    monkeypatch.setattr(runner, "run_clock", lambda: clock["now"])
    prompts = [torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9]]), torch.tensor([[10, 11]]), torch.tensor([[3, 4]])]
    settings = BenchSettings(max_new_tokens=3, warmup=0, max_seconds=25.0)
    results = run_benchmark(*llama_pair, prompts, resolve_strategies(["ngram"]), settings, progress=False)
    assert [c["prompt"] for c in results["calls"]] == [0, 0, 1, 1]
    assert results["time_limited"] == {"prompts_measured": 2, "prompts_given": 4, "max_seconds": 25.0}
    assert "after 2 of 4 prompts" in settings_line(results)
    unlimited = run_benchmark(*llama_pair, prompts[:2], resolve_strategies(["ngram"]), BenchSettings(max_new_tokens=3,
                              warmup=0), progress=False)
    assert unlimited["time_limited"] is None and len(unlimited["calls"]) == 4


@pytest.mark.parametrize(("flags", "expected"), [(["avx2"], "float32"), (["avx2", "avx512_bf16"], "bfloat16"),
                                                 (["neon", "bf16"], "bfloat16")])
def test_auto_dtype_is_bfloat16_only_where_it_is_native(monkeypatch, flags, expected):
    from hf_specdec.runtime import devices as environment
    from hf_specdec_tools.bench.cli import resolve_dtype

    monkeypatch.setattr(environment, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("float16") == "float16"  # an explicit dtype is kept


def test_runner_refuses_a_run_without_plain_first(llama_pair):
    with pytest.raises(ValueError, match="plain"):
        run_benchmark(*llama_pair, [torch.tensor([[5, 6, 7]])], [parse_strategy("tree")], BenchSettings(),
                      progress=False)


def test_forward_counter_counts_top_level_passes_once():
    model = tiny_model("qwen2", 0)
    counter = ForwardCounter(model)
    try:
        ids = torch.tensor([[5, 6, 7]])
        model(ids)  # the LM calls its base model inside: one pass
        model.model(ids)  # a drafter skipping the head: still one pass
        assert counter.take() == 2
        model.generate(ids, max_new_tokens=3, do_sample=False)
        assert counter.take() == 3
    finally:
        counter.remove()
    model(ids)
    assert counter.calls == 0


# --- prompts and models -----------------------------------------------------------------------------------------


def test_prompt_sources(tmp_path):
    from tests.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    text = tmp_path / "p.txt"
    text.write_text("w7 w8 w9\n\nw10 w11\n")
    chats = tmp_path / "chats.json"
    chats.write_text(json.dumps([[{"role": "user", "content": "w7 w8"}], {"messages": [
        {"role": "system", "content": "w9"}, {"role": "user", "content": "w10"}]}]))
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "w12 w13"}\n')
    assert load_prompt_source(str(text)) == ["w7 w8 w9", "w10 w11"]
    assert load_prompt_source(str(lines)) == ["w12 w13"]
    loaded = load_prompt_source(str(chats))
    assert isinstance(loaded[0], list) and loaded[1][0]["role"] == "system"
    ids = tokenize_prompts(tokenizer, loaded)
    assert ids[0].shape[0] == 1
    assert tokenizer.decode(ids[0][0]).split() == ["<|user|>", "w7", "w8", "<|assistant|>"]
    with pytest.raises(PromptError, match="humaneval"):
        load_prompt_source(str(tmp_path / "missing.txt"))
    with pytest.raises(PromptError, match="integer"):
        load_prompt_source("humaneval:many")


def test_humaneval_and_rewrite_prompts():
    assert len(load_prompt_source("humaneval:3")) == 3
    chats = load_prompt_source("rewrite:2")
    assert len(chats) == 2 and chats[0][0]["role"] == "user"
    body = chats[0][0]["content"]
    assert "solve" in body and load_prompt_source("humaneval:1")[0] in body  # the answer repeats the input
    with pytest.raises(PromptError, match="rewrite"):
        load_prompt_source("rewrite:0x")


def test_chat_prompts_cover_the_general_chat_kinds():
    """`--prompts chat`: the kinds general-chat benchmarks measure, a long retrieved context among them, as chats the
    chat template renders; `chat:N` the first N; the package ships the file."""
    from hf_specdec_tools.prompts import CHAT_PROMPTS

    kinds = [json.loads(line)["kind"] for line in CHAT_PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert kinds == ["multi-turn chat", "multi-turn chat", "translation", "summarization", "question answering",
                     "math reasoning", "retrieval-augmented QA (long context)"]
    chats = load_prompt_source("chat")
    assert len(chats) == 7 and load_prompt_source("chat:2") == chats[:2]
    assert [message["role"] for message in chats[0]] == ["user", "assistant", "user"]  # a turn to continue
    assert chats[-1][0]["role"] == "system" and len(chats[-1][0]["content"]) > 3000
    assert all(chat[-1]["role"] == "user" for chat in chats)
    ids = tokenize_prompts(tiny_tokenizer(), chats)
    assert len(ids) == 7 and all(prompt.shape[0] == 1 for prompt in ids)
    with pytest.raises(PromptError, match="at least one"):
        load_prompt_source("chat:0")


def test_code_prompts_are_cut_from_the_standard_library_after_a_def():
    import ast

    prompts = load_prompt_source("code:4")
    assert len(prompts) == 4 and len(set(prompts)) == 4
    assert load_prompt_source("code:4") == prompts  # the same cut every time
    for prompt in prompts:
        lines = prompt.splitlines()
        assert 5 <= len(lines) <= 40
        assert any(line.lstrip().startswith("def ") for line in lines[-20:])  # a function whose body is to come
    with pytest.raises(SyntaxError):  # cut inside the function: its body is not complete
        ast.parse(prompts[0])


def test_long_code_prompts_keep_every_context_line_and_end_at_a_def():
    from hf_specdec_tools.prompts import code_prompts

    prompts = code_prompts(3, 120, full_context=True)
    assert len(prompts) == 3 and len(set(prompts)) == 3
    for prompt in prompts:
        lines = prompt.splitlines()
        assert len(lines) == 120  # never cut short at the file's top, as the default set's may be
        assert any(line.lstrip().startswith("def ") for line in lines[-20:])
    assert code_prompts(3) != prompts  # the default set keeps its own cuts


def test_settings_line_says_what_prepacking_did():
    results = {"models": {"kernels": {"target": {"prepacked": True, "reason": "...", "ms_before": {"1": 140.0},
                                                 "ms_after": {"1": 70.0}},
                                      "draft": {"prepacked": False, "reason": "quantized", "ms_before": {},
                                                "ms_after": {}}}},
               "settings": {"max_new_tokens": 8}, "calls": []}
    kernels = settings_line(results).split("Kernels:")[1]
    assert "target Linear weights prepacked for oneDNN (1 token(s) 140 → 70 ms)" in kernels and "draft" not in kernels
    assert "plain `generate` included" in kernels


def test_offloaded_target_loads_from_a_folder(tmp_path):
    from tests.tiny import tiny_tokenizer

    folder = tmp_path / "tiny"
    tiny_model("llama", 0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    loaded = load_models(str(folder), None, dtype=torch.float32, need_draft=False, offload=True,
                         offload_max_memory="20KB")
    try:
        assert loaded.draft is None
        assert loaded.info["offload"]["modules_per_place"].get("disk", 0) >= 1
        assert loaded.info["target"]["parameters"] > 0
        ids = torch.tensor([[5, 6, 7]])
        plain = tiny_model("llama", 0).generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(loaded.target.generate(ids, max_new_tokens=4, do_sample=False), plain)
    finally:
        loaded.cleanup()
    with pytest.raises(ValueError, match="--draft"):
        load_models(str(folder), None, need_draft=True)


def test_quantized_target_auto_times_every_route_and_keeps_the_fastest(tmp_path, monkeypatch):
    """`--quantize-target auto` loads the target through each available route, times it, keeps the fastest and says
    so; the choice follows the measured times (here made up, so that each route wins once)."""
    from hf_specdec.runtime.model_info import quantization
    from hf_specdec_tools.bench import loading, target_quantization
    from tests.tiny import tiny_tokenizer

    folder = tmp_path / "tiny"
    tiny_model("llama", 0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    real_measure = target_quantization.measure_latency
    for winner in ("none", "int8"):
        def timed(model, sizes, *args, winner=winner, **kwargs):
            curve = real_measure(model, sizes, *args, **kwargs)
            route = "none" if quantization(model) is None else "int8"
            seconds = 0.001 if route == winner else 1.0
            return type(curve)(curve.sizes, tuple(seconds for _ in curve.sizes), curve.past_length)

        monkeypatch.setattr(target_quantization, "measure_latency", timed)
        monkeypatch.setattr(loading, "automatic_routes", lambda: ["int8"])
        loaded = load_models(str(folder), None, dtype=torch.float32, need_draft=False, quantize_target="auto",
                             remeasure=True)
        quantized = loaded.info["target_quantization"]
        assert quantized["route"] == winner and set(quantized["ms_per_pass_by_route"]) == {"none", "int8"}
        assert (quantization(loaded.target) is not None) == (winner == "int8")
        assert "picked automatically" in settings_line({"models": loaded.info, "settings": {}, "calls": []})
    with pytest.raises(ValueError, match="Unknown target quantization 'int3'"):
        load_models(str(folder), None, need_draft=False, quantize_target="int3")
    for route in ("auto", "int8"):
        with pytest.raises(ValueError, match="cannot be combined with --offload.*Quantize the target or offload it"):
            load_models(str(folder), None, need_draft=False, quantize_target=route, offload=True)


def test_a_route_much_slower_than_the_best_is_timed_for_one_pass_only():
    """A route whose first timed pass is over twice the best's stops there (prompt, warm-up, one timing: three
    passes), so a losing route costs a first run seconds, not a whole curve; a route as fast is timed whole."""
    import time

    from hf_specdec_tools.bench.target_quantization import fastest_route

    models = {None: tiny_model("llama", 0), "slow": tiny_model("llama", 0), "same": tiny_model("llama", 0)}
    passes = {route: 0 for route in models}

    def counted(route, delay):
        def hook(module, args):
            passes[route] += 1
            time.sleep(delay)
        return hook

    models[None].register_forward_pre_hook(counted(None, 0.01))
    models["slow"].register_forward_pre_hook(counted("slow", 0.1))
    models["same"].register_forward_pre_hook(counted("same", 0.01))
    route, model, timings = fastest_route(models.__getitem__, [None, "slow", "same"], progress=False)
    assert passes["slow"] == 3 and list(timings["slow"]) == [1]
    assert passes[None] == passes["same"] == 1 + 2 * (1 + 2)  # prompt, then per size a warm-up and two timings
    assert list(timings["same"]) == list(timings["none"]) == [1, 16]
    assert route in (None, "same") and model is models[route]


def test_auto_never_picks_a_route_that_widens_the_rows_gap(tmp_path, monkeypatch):
    """int8 activations turn bfloat16's rounding gap between a tree pass and one-token passes into whole
    quantization steps (measured: logits 1.03 apart against 0.16 unquantized), so `auto` leaves int8-dynamic out,
    and a choice remembered from before is timed again rather than reused."""
    from hf_specdec_tools.bench import loading, machine_choices, target_quantization
    from tests.tiny import tiny_tokenizer

    assert not target_quantization.ROUTES["int8-dynamic"].keeps_rows and target_quantization.ROUTES["int8"].keeps_rows
    assert "int8-dynamic" not in target_quantization.automatic_routes()
    folder = tmp_path / "tiny"
    tiny_model("llama", 0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    timed = []
    real_measure = target_quantization.measure_latency
    monkeypatch.setattr(target_quantization, "measure_latency",
                        lambda *args, **kwargs: timed.append(1) or real_measure(*args, **kwargs))
    monkeypatch.setattr(loading, "automatic_routes", lambda: [])
    key = machine_choices.machine_key(f"{folder}|None|int8=False|vocabulary=None|offload=False", torch.float32)
    machine_choices.remember(key, {"route": "int8-dynamic", "prepacked": {}})
    loaded = load_models(str(folder), None, dtype=torch.float32, need_draft=False, quantize_target="auto")
    assert timed and loaded.info["target_quantization"]["route"] == "none" and loaded.info["remembered"] is None


@pytest.mark.parametrize("scheme", ["dynamic-int8", "int4"])
def test_draft_vocabulary_restricts_the_loaded_draft(tmp_path, scheme):
    """--draft-vocabulary K: the draft's output layer covers K tokens ranked on the shipped corpus, quantized after
    with --draft-scheme."""
    from tests.tiny import tiny_tokenizer

    folder = tmp_path / "tiny"
    tiny_model("llama", 0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    loaded = load_models(str(folder), str(folder), dtype=torch.float32, int8_draft=True, draft_vocabulary=8,
                         draft_scheme=scheme)
    kept = loaded.draft.get_output_embeddings().token_ids
    assert len(kept) <= 8 + len(loaded.tokenizer.all_special_ids)
    assert loaded.info["draft_quantization"] == f"{scheme}, vocabulary {len(kept)}"
    ids = torch.tensor([[5, 6, 7, 8]])
    out = loaded.target.generate(ids, assistant_model=loaded.draft, speculation="chain", do_sample=False,
                                 max_new_tokens=8)
    assert torch.equal(out, loaded.target.generate(ids, do_sample=False, max_new_tokens=8))


def test_automatic_choices_are_remembered_per_machine(tmp_path, monkeypatch):
    """The first run times the routes and prepacking and saves what won; the next reuses it without timing anything
    and says so; --remeasure times again; another dtype is another key."""
    from hf_specdec_tools.bench import loading, target_quantization
    from tests.tiny import tiny_tokenizer

    folder = tmp_path / "tiny"
    tiny_model("llama", 0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    timings = []
    real_measure = target_quantization.measure_latency

    def timed(*args, **kwargs):
        timings.append(1)
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(target_quantization, "measure_latency", timed)
    monkeypatch.setattr(loading, "automatic_routes", lambda: ["int8"])
    first = load_models(str(folder), None, dtype=torch.float32, need_draft=False, quantize_target="auto")
    assert len(timings) == 2 and first.info["remembered"] is None
    again = load_models(str(folder), None, dtype=torch.float32, need_draft=False, quantize_target="auto")
    assert len(timings) == 2 and again.info["remembered"]  # nothing timed: the saved choice, and when it was made
    assert again.info["target_quantization"]["route"] == first.info["target_quantization"]["route"]
    load_models(str(folder), None, dtype=torch.float32, need_draft=False, quantize_target="auto", remeasure=True)
    load_models(str(folder), None, dtype=torch.bfloat16, need_draft=False, quantize_target="auto")
    assert len(timings) == 6


def test_llama_cpp_row_is_skipped_with_the_reason(run, monkeypatch, capsys):
    from hf_specdec_tools.bench import llama_cpp
    from hf_specdec_tools.bench.cli import add_llama_cpp_row

    results = {**run[0], "calls": list(run[0]["calls"]), "strategies": list(run[0]["strategies"])}
    monkeypatch.setattr(llama_cpp, "unavailable", lambda: "llama-cpp-python is not installed; install it")
    add_llama_cpp_row(results, [], BenchSettings(max_new_tokens=NEW), None, None, progress=False)
    assert results["llama_cpp"] == {"skipped": "llama-cpp-python is not installed; install it"}
    assert "llama.cpp row skipped: llama-cpp-python is not installed" in capsys.readouterr().err
    assert "llama.cpp row skipped" in settings_line(results)
    assert len(results["strategies"]) == len(run[0]["strategies"])  # no row added
    monkeypatch.setattr(llama_cpp, "unavailable", lambda: None)
    add_llama_cpp_row(results, [], BenchSettings(max_new_tokens=NEW), None, "some/other-model", progress=False)
    assert "not the embedded model" in results["llama_cpp"]["skipped"]


def test_a_failing_llama_cpp_row_keeps_the_run(run, monkeypatch, capsys):
    """The row is optional: a failed download or load is reported in the results, never raised over the run."""
    from hf_specdec_tools import models
    from hf_specdec_tools.bench import llama_cpp
    from hf_specdec_tools.bench.cli import add_llama_cpp_row

    def broken(spec, progress=True):
        raise OSError("no network")

    results = {**run[0], "calls": list(run[0]["calls"]), "strategies": list(run[0]["strategies"])}
    monkeypatch.setattr(llama_cpp, "unavailable", lambda: None)
    monkeypatch.setattr(models, "fetch_gguf", broken)
    add_llama_cpp_row(results, [None] * 2, BenchSettings(max_new_tokens=NEW), None, None, progress=False)
    assert results["llama_cpp"] == {"skipped": "it failed (OSError: no network)"}
    assert results["summary"] == run[0]["summary"]
    interrupted = {**results, "interrupted": True}
    add_llama_cpp_row(interrupted, [], BenchSettings(max_new_tokens=NEW), None, None, False)
    assert interrupted["llama_cpp"] == {"skipped": "the run was interrupted"}


def test_llama_cpp_row_is_a_reference_row_relative_to_plain(run, monkeypatch, tmp_path):
    """With llama-cpp-python present, its calls join the table as a reference: speedup against plain on the same
    prompts, outputs not compared (its own numerics)."""
    from hf_specdec_tools import models
    from hf_specdec_tools.bench import llama_cpp
    from hf_specdec_tools.bench.cli import add_llama_cpp_row

    results = {**run[0], "calls": list(run[0]["calls"]), "strategies": list(run[0]["strategies"])}
    plain_seconds = {c["prompt"]: c["seconds"] for c in results["calls"] if c["strategy"] == "plain"}

    def fake_run(gguf, prompts, max_new_tokens, progress=True):
        return [{**next(c for c in results["calls"] if c["strategy"] == "plain" and c["prompt"] == i),
                 "strategy": llama_cpp.LABEL, "seconds": plain_seconds[i] / 4, "identical": None,
                 "speculation_stats": None} for i in range(len(prompts))]

    monkeypatch.setattr(llama_cpp, "unavailable", lambda: None)
    monkeypatch.setattr(llama_cpp, "run_llama_cpp", fake_run)
    monkeypatch.setattr(llama_cpp, "version", lambda: "0.0-test")
    monkeypatch.setattr(models, "fetch_gguf", lambda spec, progress=True: tmp_path / "target.gguf")
    add_llama_cpp_row(results, [None] * len(plain_seconds), BenchSettings(max_new_tokens=NEW), None, None, False)
    row = next(r for r in results["summary"] if r["strategy"] == llama_cpp.LABEL)
    assert row["kind"] == "reference" and row["identical_text"] == "n/a (own numerics)"
    assert row["speedup"]["median"] == pytest.approx(4.0)
    assert "llama-cpp-python 0.0-test decoding target.gguf" in settings_line(results)


def test_plain_bfloat16_row_times_a_bfloat16_copy_after_the_run(run, llama_pair, monkeypatch, tmp_path):
    """On a CPU without native bfloat16 the run is float32; the reference row loads the target again in bfloat16
    and times plain generate on the measured prompts, relative to float32 plain, outputs not compared."""
    from types import SimpleNamespace

    from hf_specdec_tools.bench import bf16_reference
    from hf_specdec_tools.bench.cli import add_plain_bfloat16_row

    llama_pair[0].save_pretrained(tmp_path / "target")
    loaded = SimpleNamespace(info={"target": {"source": str(tmp_path / "target")}, "offload": None,
                                   "target_quantization": {"route": "none"}})
    dtypes = []
    load = bf16_reference.AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        model = load(*args, **kwargs)
        dtypes.append(model.dtype)
        return model

    monkeypatch.setattr(bf16_reference.AutoModelForCausalLM, "from_pretrained", recording)
    results = {**run[0], "calls": list(run[0]["calls"]), "strategies": list(run[0]["strategies"])}
    generator = torch.Generator().manual_seed(0)
    prompts = [random_prompt(generator, 10), random_prompt(generator, 14)]
    settings = BenchSettings(max_new_tokens=NEW, warmup_tokens=2)
    add_plain_bfloat16_row(results, loaded, prompts, settings, None, "bfloat16", progress=False)
    assert "plain_bfloat16" not in results and not dtypes  # a bfloat16 run needs no bfloat16 reference
    add_plain_bfloat16_row(results, loaded, prompts, settings, True, "float32", progress=False)
    assert dtypes == [torch.bfloat16]
    calls = [c for c in results["calls"] if c["strategy"] == bf16_reference.LABEL]
    assert sorted(c["prompt"] for c in calls) == [0, 1] and set(calls[0]) == CALL_KEYS
    assert all(0 < c["new_tokens"] <= NEW and c["target_passes"] == c["new_tokens"] for c in calls)
    row = next(r for r in results["summary"] if r["strategy"] == bf16_reference.LABEL)
    assert row["kind"] == "reference" and row["identical_text"] == "n/a (own numerics)" and row["prompts"] == 2
    assert row["speedup"]["median"] > 0 and "`plain (bfloat16)`: plain `generate`" in settings_line(results)
    assert results["summary"][: len(run[0]["summary"])] == run[0]["summary"]  # the run's own rows unchanged


def test_one_row_packing_row_repacks_the_target_and_packs_it_back(run, llama_pair):
    """The reference row times plain generate on the prepacked target repacked for one-token passes, after the
    run, and leaves the target packed (and decoding) as it was; an unpacked target skips the row, saying why."""
    import copy

    from hf_specdec.kernels import prepack
    from hf_specdec.runtime.devices import kernels
    from hf_specdec_tools.bench import packing_reference
    from hf_specdec_tools.bench.cli import add_one_row_packing_row

    generator = torch.Generator().manual_seed(0)
    prompts = [random_prompt(generator, 10), random_prompt(generator, 14)]
    settings = BenchSettings(max_new_tokens=NEW, warmup_tokens=2)
    target = copy.deepcopy(llama_pair[0])
    results = {**run[0], "calls": list(run[0]["calls"]), "strategies": list(run[0]["strategies"])}
    add_one_row_packing_row(results, target, prompts, settings, progress=False)
    assert "not prepacked" in results["plain_one_row_packing"]["skipped"]
    assert "plain (packed for 1 row) row skipped: the target is not prepacked" in settings_line(results)
    assert not any(c["strategy"] == packing_reference.LABEL for c in results["calls"])

    assert prepack(target, measure=False).packed
    before = target.generate(prompts[0], max_new_tokens=NEW, do_sample=False)
    packings = []
    target.register_forward_pre_hook(lambda module, args: packings.append(kernels(module)))
    add_one_row_packing_row(results, target, prompts, settings, progress=False)
    assert set(packings) == {"onednn-prepacked-1-rows"}  # every timed pass ran on the one-row packing
    assert kernels(target) == "onednn-prepacked"  # packed back
    assert torch.equal(target.generate(prompts[0], max_new_tokens=NEW, do_sample=False), before)
    calls = [c for c in results["calls"] if c["strategy"] == packing_reference.LABEL]
    assert sorted(c["prompt"] for c in calls) == [0, 1] and set(calls[0]) == CALL_KEYS
    row = next(r for r in results["summary"] if r["strategy"] == packing_reference.LABEL)
    assert row["kind"] == "reference" and row["identical_text"] == "n/a (own numerics)" and row["speedup"]["median"] > 0
    assert "`plain (packed for 1 row)`: plain `generate`" in settings_line(results)


def test_plain_bfloat16_row_by_default_only_where_bfloat16_is_not_native(monkeypatch):
    from hf_specdec_tools.bench import bf16_reference

    monkeypatch.setattr(bf16_reference, "native_bfloat16", lambda cuda: False)
    assert bf16_reference.wanted_by_default("float32", offload=False, route="none")
    assert not bf16_reference.wanted_by_default("bfloat16", offload=False, route="none")
    assert not bf16_reference.wanted_by_default("float32", offload=True, route="none")
    assert not bf16_reference.wanted_by_default("float32", offload=False, route="int8")
    monkeypatch.setattr(bf16_reference, "native_bfloat16", lambda cuda: True)
    assert not bf16_reference.wanted_by_default("float32", offload=False, route="none")


# --- report and README ------------------------------------------------------------------------------------------


def _full_results(run) -> dict:
    results, _ = run
    return {"schema": SCHEMA, "environment": {"cpu": "test CPU", "torch_threads": 1, "versions": {"torch": "x"}},
            "models": {"target": {"name": "tiny-0", "parameters": 10**6}, "draft": {"name": "tiny-1",
                       "parameters": 10**6}, "dtype": "float32", "offload": None}, **results}


def test_report_writes_json_markdown_and_plots(run, tmp_path):
    results = _full_results(run)
    paths = write_report(results, tmp_path)
    assert load_json(paths["json"])["calls"] == json.loads(json.dumps(results["calls"]))
    md = (tmp_path / RESULTS_MD).read_text()
    assert "**Machine:** test CPU" in md and "| `plain` | 2/2 |" in md and "![speedup](speedup.png)" in md
    for kind in ("speedup", "tokens_per_step", "time_split"):
        assert paths[kind].read_bytes().startswith(b"\x89PNG")
    assert "budget" not in paths  # no budget sweep in this run


def test_a_greedy_difference_is_located_and_judged_by_plains_own_margin():
    """A call that leaves plain is reported with where and by what margin plain's own pass chose: within two rounding
    steps of the dtype (a bfloat16 near-tie) it is told apart from a wider, real difference."""
    from types import SimpleNamespace

    from hf_specdec_tools.bench.runner import first_difference

    model = tiny_model("llama", 0)  # float32
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = model.generate(ids, do_sample=False, max_new_tokens=6)
    with torch.no_grad():
        logits = model(input_ids=plain[:, :6]).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    other = plain.clone()
    other[0, 6] = runner_up
    found = first_difference(model, plain, other, ids.shape[1])
    margin = float(logits[plain[0, 6]] - logits[runner_up])
    assert found["new_token"] == 2 and found["margin"] == pytest.approx(margin, abs=1e-5)
    assert margin > 1e-3 and not found["near_tie"]  # float32: far wider than its rounding

    class Target:  # computes in bfloat16 and hands its logits out upcast, as some models do
        dtype = torch.bfloat16

        def __init__(self, tied_by: float) -> None:
            self.row = torch.full((1, 1, 32), -5.0)
            self.row[0, 0, 3], self.row[0, 0, 4] = 20.25, 20.25 - tied_by  # one bfloat16 step near 20 is 0.125

        def __call__(self, **kwargs):
            return SimpleNamespace(logits=self.row)

    target = Target

    plain, other = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 4]])
    tie = first_difference(target(0.125), plain, other, 2)
    assert tie == {"new_token": 0, "margin": 0.125, "rounding_step": 0.125, "near_tie": True}
    assert not first_difference(target(1.0), plain, other, 2)["near_tie"]
    shorter = first_difference(target(0.125), plain, plain[:, :2], 1)
    assert shorter["margin"] is None and not shorter["near_tie"]

    calls = [{"strategy": label, "prompt": prompt, "seconds": 1.0, "new_tokens": 6, "target_steps": 2,
              "target_passes": 3, "draft_passes": 0, "peak_rss_delta_bytes": 0, "identical": identical,
              **({"difference": difference} if difference else {})}
             for label, prompt, identical, difference in [
                 ("plain", 0, True, None), ("plain", 1, True, None), ("plain", 2, True, None),
                 ("chain", 0, True, None), ("chain", 1, False, tie), ("chain", 2, False, {**tie, "near_tie": False})]]
    strategies = [parse_strategy(name).to_dict() for name in ("plain", "chain")]
    (chain,) = [row for row in summarize(calls, strategies, sampling=False) if row["strategy"] == "chain"]
    assert chain["identical_text"] == "1/3 (1 at a near-tie)" and chain["near_ties"] == 1


def test_budget_sweep_plot(run, tmp_path):
    results = _full_results(run)
    base = next(row for row in results["summary"] if row["name"] == "specexec")
    sweep = [parse_strategy(f"specexec:budget={b}").to_dict() for b in (8, 16, 32)]
    calls = [dict(c) for c in results["calls"] if c["strategy"] == "plain"]
    for strategy in sweep:
        calls += [{**c, "strategy": strategy["label"]} for c in results["calls"] if c["strategy"] == base["strategy"]]
    summary = summarize(calls, [results["strategies"][0], *sweep], sampling=False)
    assert list(budget_sweeps(summary)) == ["specexec"]
    paths = write_report({**results, "calls": calls, "summary": summary}, tmp_path)
    assert paths["budget"].name == PLOTS["budget"] and paths["budget"].read_bytes().startswith(b"\x89PNG")


def test_readme_region_round_trips(run, tmp_path):
    results = _full_results(run)
    folder = tmp_path / "benchmarks" / "cpu"
    write_report(results, folder)
    readme = tmp_path / "README.md"
    before, after = "# Title\n\n## Results\n\nIntro.\n\n", "\n\n## Development\n\nMore.\n"
    readme.write_text(f"{before}{START}\nold text\n{END}{after}")
    update_readme(readme, folder / "results.json")
    text = readme.read_text()
    assert text.startswith(before + START) and text.endswith(END + after)
    assert "old text" not in text and "| `plain` | 2/2 |" in text
    assert "](benchmarks/cpu/speedup.png)" in text and "hf-specdec bench report benchmarks/cpu/results.json" in text
    update_readme(readme, folder / "results.json")
    assert readme.read_text() == text  # idempotent


@pytest.mark.parametrize(
    "text, words",
    [
        ("# no markers\n", ["exactly one", START, "## Results"]),
        (f"{START}\n{START}\n{END}\n", ["found 2 and 1"]),
        (f"{END}\nx\n{START}\n", ["before", "swap"]),
    ],
)
def test_readme_without_proper_markers_fails_clearly(text, words):
    with pytest.raises(ReadmeError) as error:
        replace_region(text, "table", "README", START, END, SECTION)
    for word in words:
        assert word in str(error.value)


def test_cli_report_and_errors(run, tmp_path, capsys):
    from hf_specdec_tools.cli import main

    results = _full_results(run)
    write_report(results, tmp_path)
    (tmp_path / "speedup.png").unlink()
    readme = tmp_path / "README.md"
    readme.write_text(f"## Results\n{START}\n{END}\n")
    assert main(["bench", "report", str(tmp_path / "results.json"), "--readme", str(readme)]) == 0
    assert (tmp_path / "speedup.png").is_file() and "| `plain` |" in readme.read_text()
    assert main(["bench", "report", str(tmp_path / "missing.json")]) == 2
    assert main(["bench", "--strategy", "nope"]) == 2
    assert main(["bench", "--offload-max-memory", "1GB", "--strategy", "tree"]) == 2
    assert main(["bench", "--quick", "--max-minutes", "0"]) == 2
    err = capsys.readouterr().err
    assert "Known strategies" in err and "--offload" in err and "No results file" in err
    assert "--max-minutes must be positive" in err


def test_bracketed_plain_runs_first_and_last_and_ratios_divide_by_its_calls_mean(llama_pair, monkeypatch):
    """Plain's first call of each round takes 1 fake second and its last 3, `ngram`'s 1: the ratio is 2, the mean of
    plain's two calls over `ngram`'s, where one plain call alone would have made it 1 or 3."""
    from hf_specdec_tools.bench import runner

    order, real = [], runner.measure_call

    def timed(target, draft, counters, strategy, *args, **kwargs):
        record, output = real(target, draft, counters, strategy, *args, **kwargs)
        plain_calls = sum(label == "plain" for label in order)
        order.append(strategy.label)
        record["seconds"] = (1.0 if plain_calls % 2 == 0 else 3.0) if strategy.label == "plain" else 1.0
        return record, output

    monkeypatch.setattr(runner, "measure_call", timed)
    prompts = [torch.tensor([[5, 6, 7]]), torch.tensor([[8, 9]])]
    strategies = resolve_strategies(["ngram", "chain"])
    results = run_benchmark(*llama_pair, prompts, strategies, BenchSettings(max_new_tokens=3, warmup=0,
                                                                            bracket_plain=True), progress=False)
    plain, ngram, chain = (strategy.label for strategy in strategies)
    assert order == [plain, ngram, chain, plain, plain, chain, ngram, plain]
    rows = {row["strategy"]: row for row in results["summary"]}
    assert rows[ngram]["speedups"] == pytest.approx([2.0, 2.0])
    assert all(call["identical"] for call in results["calls"])
    assert "plain run first and last on every prompt" in settings_line(results)
