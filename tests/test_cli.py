"""The `hf-specdec` command: every sub-command is listed, and the demo runs end to end (on tiny models here)."""

from __future__ import annotations

import pytest

from hf_specdec_tools import cli
from hf_specdec_tools.bench import loading
from hf_specdec_tools.bench.loading import LoadedModels
from tests.conftest import tiny_model
from tests.tiny import tiny_tokenizer

COMMANDS = ("models", "plan", "calibrate", "demo", "bench")


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    for command in COMMANDS:
        assert command in text
    assert cli.main([]) == 2  # no command: help, and a usage exit code


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0 and "usage: hf-specdec" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_missing_extra_says_what_to_install(command, monkeypatch, capsys):
    """Installed without the [bench] extra (no matplotlib), `hf-specdec bench --help` names the extra, no traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: `import matplotlib` fails
    assert cli.main([command, "--help"]) == 2
    error = capsys.readouterr().err
    assert f"hf-specdec {command} needs the [bench] extra" in error and "pip install 'hf_specdec[bench]'" in error
    assert cli.main(["families"]) == 0  # commands that need no extra still run


def test_demo_prints_the_comparison_table(monkeypatch, capsys):
    target = tiny_model("llama", 0)

    def tiny_pair(**kwargs):
        return LoadedModels(target, tiny_model("llama", 0), tiny_tokenizer())

    monkeypatch.setattr(loading, "load_models", tiny_pair)
    monkeypatch.setattr("hf_specdec_tools.bench.inputs.humaneval_prompts", lambda n: ["w7 w8 w9", "w10 w11"][:n])
    assert cli.main(["demo", "--prompts", "2", "--max-new-tokens", "12", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    for method in ("`plain`", "`chain`", "`tree`", "`sequoia`", "`specexec`"):
        assert method in out
    assert out.count("| 2/2 |") == 5  # every method reproduced plain on both prompts
    assert cli.main(["demo", "--methods", "nope"]) == 2


def test_demo_says_why_a_greedy_call_left_plain():
    """A near-tie of the dtype's rounding is told apart from a fault, with where it happened and by what margin."""
    from hf_specdec_tools.demo import difference_line

    tie = {"strategy": "chain", "prompt": 2, "difference": {"new_token": 26, "margin": 0.125, "rounding_step": 0.125,
                                                            "near_tie": True}}
    line = difference_line(tie, "bfloat16")
    assert line.startswith("`chain` left plain on prompt 3 at new token 26") and "0.125 above the other" in line
    assert "a near-tie in bfloat16" in line and "float32 output is identical" in line
    fault = {**tie, "difference": {**tie["difference"], "margin": 3.0, "near_tie": False}}
    assert "a fault, please report it" in difference_line(fault, "float32")
    shorter = {**tie, "difference": {**tie["difference"], "margin": None}}
    assert difference_line(shorter, "bfloat16").endswith("it stopped at another length.")


def test_demo_defaults_to_what_this_hardware_runs_fastest(monkeypatch, capsys):
    """On a CPU without native bfloat16 the demo loads float32 and an int8 draft; with it, bfloat16; on a CPU it
    times the target's quantization routes and keeps the fastest (`auto`)."""
    import torch

    from hf_specdec.runtime import devices as environment

    asked = []

    def tiny_pair(**kwargs):
        asked.append(kwargs)
        return LoadedModels(tiny_model("llama", 0), tiny_model("llama", 0), tiny_tokenizer())

    monkeypatch.setattr(loading, "load_models", tiny_pair)
    monkeypatch.setattr("hf_specdec_tools.bench.inputs.humaneval_prompts", lambda n: ["w7 w8 w9"][:n])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for flags, dtype in ((["avx2"], torch.float32), (["avx2", "amx_bf16"], torch.bfloat16)):
        monkeypatch.setattr(environment, "cpu_flags", lambda flags=flags: flags)
        assert cli.main(["demo", "--prompts", "1", "--max-new-tokens", "4", "--methods", "chain"]) == 0
        assert asked[-1] == {"dtype": dtype, "int8_draft": True, "prepack": True, "quantize_target": "auto",
                             "remeasure": False, "draft_vocabulary": None}
    assert cli.main(["demo", "--prompts", "1", "--max-new-tokens", "4", "--methods", "chain", "--no-int8-draft"]) == 0
    assert asked[-1]["int8_draft"] is False
