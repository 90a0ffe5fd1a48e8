"""The dsv4 command: bad arguments are one line on stderr with exit code 2, long steps show
progress, every option has help, --help does not import torch."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys

import pytest
import torch

from dsv4.cli import build_parser, main

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def one_error_line(capsys, rc, match, command):
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dsv4 {command}: error: "), err
    assert match in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,match", [
    (["verify", "--platform", "int8"], "unknown platform 'int8'; valid platforms:"),
    (["verify", "--tokens", "0"], "--tokens 0: must be at least 16"),
    (["verify", "--tokens", "-3"], "--tokens -3: must be at least 16"),
    (["verify", "--tokens", "15"], "pooled mode"),
    (["eval", "--problems", "0"], "--problems 0: must be at least 1"),
    (["eval", "--problems", "401"], "the held-out set has 400 problems"),
    (["demo", "--chunk", "0"], "--chunk 0: must be at least 1"),
    (["generate", "--prompt", "a=1;", "--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["verify", "--device", "nonsense"], "--device nonsense: not a device name"),
])
def test_bad_arguments_are_one_line(capsys, argv, match):
    one_error_line(capsys, main(argv), match, argv[0])


@no_cuda
@pytest.mark.parametrize("command", [["verify"], ["eval"], ["generate", "--prompt", "a=1;"]])
def test_cuda_without_cuda_is_one_line(capsys, command):
    one_error_line(capsys, main([*command, "--device", "cuda"]),
                   "--device cuda: CUDA is not available on this machine", command[0])


@pytest.mark.parametrize("tp,match", [
    (["1", "--dry-run"], "--tp 1: tensor parallelism needs at least 2 ranks"),
    ([str(max(2, torch.cuda.device_count() + 1))], "CUDA GPUs; this machine has"),
])
def test_tp_rank_count_is_a_usage_error(capsys, tmp_path, tp, match):
    with pytest.raises(SystemExit) as e:
        main(["bench", "decode-step", "--tp", *tp, "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsv4 bench decode-step: error: ")
    assert match in err[0]
    assert not (tmp_path / "out").exists()


@no_cuda
@pytest.mark.parametrize("suite", ["decode-step", "prefill", "attention-kernels", "input-proj"])
def test_gpu_bench_without_cuda_is_one_line(capsys, tmp_path, suite):
    with pytest.raises(SystemExit) as e:
        main(["bench", suite, "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dsv4 bench {suite}: error: needs a CUDA GPU (the results of the latest GPU "
                   "runs are in benchmarks/results/, by date and card)"]


@pytest.mark.parametrize("suite,bad", [("prefill", ["--reps", "0"]),
                                       ("decode-step", ["--layers", "C8"]),
                                       ("attention-kernels", ["--only", "fft"])])
def test_gpu_bench_arguments_are_checked_before_cuda(capsys, tmp_path, suite, bad):
    with pytest.raises(SystemExit) as e:
        main(["bench", suite, "--out", str(tmp_path), *bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and bad[0].lstrip("-") in err and "needs a CUDA GPU" not in err


def test_gpu_bench_report_only_runs_anywhere(tmp_path):
    (tmp_path / "prefill.json").write_text('{"gpu": "H200", "layer_rows": [], '
                                           '"attention_rows": []}')
    assert main(["bench", "prefill", "--out", str(tmp_path), "--report-only"]) == 0
    assert (tmp_path / "prefill.md").read_text().startswith("# DSV4 prefill, H200")


def test_verify_shows_progress_per_row(capfd):
    assert main(["verify", "--platform", "reference", "--tokens", "16"]) == 0
    out, err = capfd.readouterr()
    conf = [ln for ln in err.splitlines() if ln.startswith("[verify conformance ")]
    cont = [ln for ln in err.splitlines() if ln.startswith("[verify contract ")]
    assert len(conf) == 27 and conf[-1].startswith("[verify conformance 27/27] reference")
    assert conf[-1].startswith("[verify conformance 27/27] reference[act_quant] fusion on")
    assert len(cont) == 6 and cont[0].endswith(": ok")
    assert "PASS" in out


def test_demo_rows_show_progress():
    from dsv4.demo import run_demo

    lines: list[str] = []
    rows = run_demo(tokens=20, chunk=7, log=lines.append)
    assert len(lines) == len(rows) == 9
    assert lines[0].startswith("[demo 1/9] layer 0 ratio 0 prefill: err float64")


def test_eval_shows_progress_per_run(capfd):
    assert main(["eval", "--platform", "reference", "--problems", "2"]) in (0, 1)
    err = capfd.readouterr().err
    assert "[eval 1/2] reference fusion off eager: answering 2 problems" in err
    assert "[eval 2/2] reference fusion on eager" in err
    assert err.count("[eval] done: reference") == 2


def test_eval_act_quant_runs_every_run_quantised(tmp_path, capfd, monkeypatch):
    import dsv4.tinylm.evaluate as ev

    seen = []
    real = ev.load_tiny_lm

    def spy(*args, **kw):
        seen.append(kw.get("act_quant"))
        return real(*args, **kw)

    monkeypatch.setattr(ev, "load_tiny_lm", spy)
    out = tmp_path / "e.json"
    assert main(["eval", "--platform", "reference", "--problems", "4", "--act-quant",
                 "--json", str(out)]) == 0
    assert seen == [True, True]  # the baseline and the fusion run
    assert json.loads(out.read_text())["act_quant"] is True
    assert "fp8 activations (act_quant) in every run" in capfd.readouterr().out


def test_bench_suite_help_is_the_suites_own(capsys):
    assert main(["bench", "pooled-decode", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dsv4 bench pooled-decode") and "--context CONTEXT" in out
    assert main(["bench", "--help"]) == 0
    assert "pooled-decode" in capsys.readouterr().out


def test_pooled_decode_bench_says_what_it_wrote_and_why_no_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["bench", "pooled-decode", "--out", str(tmp_path), "--ms", "2", "--context",
                 "8", "--steps", "2", "--reps", "1"]) == 0
    out, err = capsys.readouterr()
    assert "matplotlib is not installed" in err and "pooled_decode.png was not written" in err
    assert f"wrote {tmp_path / 'pooled_decode.json'}, {tmp_path / 'pooled_decode.md'}" in out
    assert not (tmp_path / "pooled_decode.png").exists()


def _options(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        else:
            yield parser.prog, action


def test_every_option_has_help_and_the_description_is_plain():
    parser = build_parser()
    missing = [f"{prog} {a.dest}" for prog, a in _options(parser) if not a.help]
    assert not missing
    assert "``" not in (parser.description or "")


def test_help_does_not_import_torch():
    code = "import dsv4.cli, sys; dsv4.cli.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_generate_states_and_checks_the_trained_format(capsys):
    parser = build_parser()
    gen = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "a=<0..99>;<4-90 filler chars>b=<0..99>" in gen.choices["generate"].format_help()
    good = "a=12;qwerty uiop zxcv b=30;lkjh gfds mnxv cxzq a+b="
    assert main(["generate", "--prompt", good, "--prompt", "a=12;b=30;a+b=",
                 "--only-answer"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "42"
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("dsv4 generate: warning: prompt 2 of 2 is "
                                                   "outside")
    assert "the first filler has 0 chars, trained on 4-90" in lines[0]
    # the runner's step counts: eager steps on the CPU, replays / captures / padded on a GPU
    assert re.fullmatch(r"dsv4 generate: \d+ decode tokens in \d+ steps, [\d.]+ s: \d+ "
                        r"tokens/s \(decode runner: (eager|replays|captures|padded) \d+"
                        r"(, (replays|captures|padded|eager) \d+)*\)", lines[1]), lines[1]


@pytest.mark.parametrize("argv,prefix,match", [
    (["demo", "--seed", "abc"], "dsv4 demo: error: ", "invalid int value: 'abc'"),
    (["frobnicate"], "dsv4: error: ", "invalid choice: 'frobnicate'"),
    (["verify", "--nope"], "dsv4 verify: error: ", "unrecognized arguments: --nope"),
    (["bench", "decode-step", "--out", "x", "--ms", "0"], "dsv4 bench decode-step: error: ",
     "expected comma-separated positive integers"),
    (["bench", "kv-memory", "--out", "x", "--models", "foo"], "dsv4 bench kv-memory: error: ",
     "model preset ['foo']"),
    (["bench", "decode-step", "--out", "x", "--plan", "fp8_max=256"],
     "dsv4 bench decode-step: error: ", "no field 'fp8_max'"),
    (["bench", "decode-step", "--out", "x", "--plan", "fp8_gemm_max_tokens=-1"],
     "dsv4 bench decode-step: error: ", "'fp8_gemm_max_tokens=-1': expected FIELD=N"),
    (["bench", "decode-step", "--out", "x", "--plan", "graph_max_tokens=8"],
     "dsv4 bench decode-step: error: ", "graph_max_tokens: the bench captures the whole step"),
    (["bench", "model-decode", "--out", "x", "--plan", "outproj=16"],
     "dsv4 bench model-decode: error: ", "no field 'outproj'"),
    (["bench", "model-decode", "--out", "x", "--dry-run", "--plan",
      "fp8_gemm_max_tokens=256"],
     "dsv4 bench model-decode: error: ", "--plan sets the cuda platform's plan"),
])
def test_argument_parser_errors_are_one_line(capsys, argv, prefix, match):
    """argparse's own errors (a type, a choice, an unknown option) - in the command, a
    subcommand or a bench suite - are one line too, without the usage block."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(prefix) and match in err[0], err


def test_bench_refuses_earlier_results_unless_overwrite(tmp_path, capsys, monkeypatch):
    """An earlier run's results are never replaced in silence; --overwrite replaces them, and
    without matplotlib says that no PNG was written (and drops the earlier PNG, which would no
    longer match)."""
    argv = ["bench", "kv-memory", "--out", str(tmp_path), "--contexts", "4096", "--models",
            "flash"]
    assert main(argv) == 0
    first = (tmp_path / "kv_memory.json").read_text()
    (tmp_path / "kv_memory.png").write_bytes(b"an earlier plot")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsv4 bench kv-memory: error: --out ")
    assert "kv_memory.json, kv_memory.md, kv_memory.png" in err[0]
    assert (tmp_path / "kv_memory.json").read_text() == first
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main([*argv, "--overwrite"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == ("dsv4 bench kv-memory: warning: matplotlib is not installed (pip "
                           "install matplotlib), so kv_memory.png was not written")
    assert not (tmp_path / "kv_memory.png").exists()
    assert "kv_memory.png" not in out.splitlines()[-1]


def _suite_parsers():
    from dsv4.cli import BENCH_SUITES

    for suite, module in sorted(BENCH_SUITES.items()):
        yield suite, importlib.import_module(module).parser(f"dsv4 bench {suite}")


def _takes_a_value(action):
    return action.nargs != 0 and action.option_strings and action.dest != "help"


def test_every_bench_option_has_help_and_its_default_stated():
    """Each suite's options are documented (dsv4 bench SUITE --help), and an option with a
    default says what it is."""
    missing, no_default = [], []
    for suite, ap in _suite_parsers():
        for a in ap._actions:
            if not a.help:
                missing.append(f"{suite} {a.dest}")
            elif _takes_a_value(a) and not a.required and "default" not in a.help:
                no_default.append(f"{suite} {a.dest}")
    assert not missing and not no_default, (missing, no_default)


def test_train_tiny_options_state_their_defaults():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    t = sub.choices["train-tiny"]
    lacking = [a.dest for a in t._actions if _takes_a_value(a) and not a.required
               and a.help is not argparse.SUPPRESS and "default" not in (a.help or "")]
    assert not lacking


def test_eval_runs_a_platform_given_twice_once(capfd):
    assert main(["eval", "--platform", "reference", "--platform", "reference",
                 "--problems", "2"]) in (0, 1)
    err = capfd.readouterr().err
    assert "[eval 2/2] reference fusion on eager" in err and "[eval 3/" not in err


def test_generate_says_why_an_answer_is_empty(capsys, monkeypatch):
    """A model that stops at once (<eos> first) leaves its line empty: stderr says why."""
    import dsv4.tinylm.generate as gen

    monkeypatch.setattr(gen, "generate", lambda model, prompts, n, stats: ["" for _ in prompts])
    good = "a=12;qwerty uiop zxcv b=30;lkjh gfds mnxv cxzq a+b="
    assert main(["generate", "--prompt", good, "--only-answer"]) == 0
    out, err = capsys.readouterr()
    assert out == "\n"
    assert err.strip().splitlines()[0] == (
        "dsv4 generate: warning: prompt 1 of 1: the model ended its answer at once (its first "
        "token was <eos>), so the answer is empty")


def test_errors_of_every_subcommand_name_it(capsys, tmp_path):
    """One prefix style: ``dsv4 <subcommand>: error:`` (argparse's own, ours, and the ones
    from a model folder)."""
    assert main(["generate", "--prompt", "", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"dsv4 generate: error: --model {tmp_path}: "
                                              "holds no config.json")
    assert main(["verify", "--platform", "int8"]) == 2
    assert capsys.readouterr().err.startswith("dsv4 verify: error: unknown platform 'int8'")


@pytest.mark.parametrize("prompt,match", [("", "prompt 2 of 2 is empty"),
                                          ("a=1;b=2;a+b=\u00e9", "prompt 2 of 2: ")])
def test_generate_names_a_bad_prompt_in_one_line_before_any_warning(capsys, prompt, match):
    """A prompt the model cannot take (empty, a character outside its vocabulary) is the one
    line on stderr, exit 2: no format warning about it or the other prompts comes first."""
    assert main(["generate", "--prompt", "a=1;b=2;a+b=", "--prompt", prompt]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, lines
    assert lines[0].startswith("dsv4 generate: error: ") and match in lines[0], lines
