"""Usage errors of the dsv4 command, run as a user runs it (a subprocess in a folder of its own):
one line on stderr, ``dsv4 <subcommand>: error: ...``, exit code 2, nothing on stdout, nothing
written, and all of it before any work (a training, an evaluation or a benchmark that would
lose its result to a bad path is refused up front)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = not torch.cuda.is_available()

pytestmark = pytest.mark.xdist_group("cli-usage")
"""One pytest-xdist worker runs this module (``--dist loadgroup``): its module fixture starts
every case's process at once, and spread over workers each of them started all of them again
(the GPU suite of 2026-12-08: 30-40 s of setup on each of ten workers)."""

# (id, argv, prog, what the line says); cwd holds README.md (a file), folder/ (empty),
# full/notes.txt (someone's file) and earlier/kv_memory.json (an earlier run's results)
CASES = [
    ("demo-typo-model", ["demo", "--model", "typo-folder"], "dsv4 demo",
     "--model typo-folder: does not exist"),
    ("demo-empty-model", ["demo", "--model", "folder"], "dsv4 demo", "holds no config.json"),
    ("kv-memory-out-file", ["bench", "kv-memory", "--out", "README.md"], "dsv4 bench kv-memory",
     "--out README.md: is a file, not a folder"),
    ("kv-memory-out-proc", ["bench", "kv-memory", "--out", "/proc/nope"],
     "dsv4 bench kv-memory", "--out /proc/nope: cannot write in /proc"),
    ("kv-memory-earlier-results", ["bench", "kv-memory", "--out", "earlier"],
     "dsv4 bench kv-memory", "holds the results of an earlier run (kv_memory.json); give "
     "another folder, or --overwrite"),
    ("eval-json-missing-dir", ["eval", "--json", "missing/dir/out.json"], "dsv4 eval",
     "--json missing/dir/out.json: folder missing/dir does not exist"),
    ("eval-json-folder", ["eval", "--json", "folder"], "dsv4 eval",
     "--json folder: is a folder; give a file name"),
    ("eval-missing-model", ["eval", "--model", "/nonexistent"], "dsv4 eval",
     "--model /nonexistent: does not exist"),
    ("pooled-decode-ms-0", ["bench", "pooled-decode", "--out", "o", "--ms", "0"],
     "dsv4 bench pooled-decode", "argument --ms: '0'"),
    ("attention-kernels-report-only-missing",
     ["bench", "attention-kernels", "--report-only", "--out", "missing"],
     "dsv4 bench attention-kernels", "--out missing: holds no results.json"),
    ("prefill-report-only-missing", ["bench", "prefill", "--report-only", "--out", "folder"],
     "dsv4 bench prefill", "--out folder: holds no prefill.json"),
    ("train-lr-negative", ["train-tiny", "--out", "o", "--lr", "-1"], "dsv4 train-tiny",
     "--lr -1.0: must be a positive number"),
    ("train-seconds-0", ["train-tiny", "--out", "o", "--seconds", "0"], "dsv4 train-tiny",
     "--seconds 0.0: must be a positive number"),
    ("train-seconds-negative", ["train-tiny", "--out", "o", "--seconds", "-5"],
     "dsv4 train-tiny", "--seconds -5.0: must be a positive number"),
    ("train-out-file", ["train-tiny", "--out", "README.md"], "dsv4 train-tiny",
     "--out README.md: is a file, not a folder"),
    ("train-out-not-empty", ["train-tiny", "--out", "full"], "dsv4 train-tiny",
     "--out full: holds other files than a tiny-LM folder's (notes.txt)"),
    ("generate-meta", ["generate", "--prompt", "a=1;", "--device", "meta"], "dsv4 generate",
     "--device meta: the meta device holds no data"),
    ("generate-model-file", ["generate", "--prompt", "a=1;", "--model", "README.md"],
     "dsv4 generate", "--model README.md: is a file, not a model folder"),
    ("verify-unknown-option", ["verify", "--nope"], "dsv4 verify",
     "unrecognized arguments: --nope"),
    ("transformers-decode-cap-on-cpu", ["bench", "transformers-decode", "--out", "o",
                                        "--device", "cpu", "--tiny", "--memory-limit-gib", "4"],
     "dsv4 bench transformers-decode", "--memory-limit-gib 4: a positive cap on a CUDA device"),
]
if NO_CUDA:
    CASES += [
        ("pooled-decode-cuda", ["bench", "pooled-decode", "--out", "o", "--device", "cuda"],
         "dsv4 bench pooled-decode", "--device cuda: CUDA is not available"),
        ("transformers-decode-no-gpu", ["bench", "transformers-decode", "--out", "o"],
         "dsv4 bench transformers-decode", "no CUDA GPU here: give --device cpu"),
    ]


def _listing(folder: Path) -> dict[str, float | None]:
    """Every entry, with its mtime for files (a folder's mtime changes when the write check
    creates and removes its probe in it, which leaves nothing)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.stat().st_mtime
            for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Every case at once (each pays for its own torch import)."""
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    started = {}
    for name, argv, _, _ in CASES:
        cwd = tmp_path_factory.mktemp(name)
        (cwd / "README.md").write_text("a file\n")
        (cwd / "folder").mkdir()
        (cwd / "full").mkdir()
        (cwd / "full" / "notes.txt").write_text("mine\n")
        (cwd / "earlier").mkdir()
        (cwd / "earlier" / "kv_memory.json").write_text("[]")
        before = _listing(cwd)
        proc = subprocess.Popen([sys.executable, "-m", "dsv4", *argv], cwd=cwd, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started[name] = (proc, cwd, before)
    out = {}
    for name, (proc, cwd, before) in started.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (proc.returncode, stdout, stderr, before, _listing(cwd))
    return out


@pytest.mark.parametrize("name,argv,prog,match", CASES, ids=[c[0] for c in CASES])
def test_a_usage_error_is_one_line_before_any_work(runs, name, argv, prog, match):
    rc, stdout, stderr, before, after = runs[name]
    lines = stderr.strip().splitlines()
    assert rc == 2, stderr
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), stderr
    assert match in lines[0], stderr
    assert stdout == ""  # no header, no progress: nothing ran
    assert after == before  # nothing written, created or touched
