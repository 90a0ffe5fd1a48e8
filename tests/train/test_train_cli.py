"""``dsv4 train-tiny`` and what it writes: limits checked before the training, progress while it
works, a folder that holds exactly the model (replaced whole, never mixed with other files),
every file with the same mode."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from dsv4 import CheckpointError
from dsv4.cli import main
from dsv4.tinylm.checkpoint import TINY_LM_FILES, load_tiny_lm, save_tiny_lm
from dsv4.tinylm.config import TinyLMConfig
from dsv4.tinylm.task import heldout_problems
from dsv4_train.lm import TrainLM
from dsv4_train.train import TrainSettings, greedy_answers, train_tiny


@pytest.mark.parametrize("change,match", [({"seconds": -5.0}, "seconds=-5.0"),
                                          ({"seconds": 0.0}, "seconds=0.0"),
                                          ({"seconds": float("nan")}, "seconds=nan"),
                                          ({"lr": -1.0}, "lr=-1.0"),
                                          ({"max_steps": -1}, "max_steps=-1")])
def test_limits_are_checked_before_the_training(change, match):
    """A negative budget used to train for ever (the loop's end was never reached)."""
    with pytest.raises(ValueError, match=match):
        train_tiny(TrainSettings(**change), log=pytest.fail)  # fails at once: no log line


def test_the_held_out_answers_show_progress():
    cfg = TinyLMConfig.preset()
    lines: list[str] = []
    greedy_answers(TrainLM(cfg).eval(), heldout_problems(3), cfg.tokenizer, batch=2, max_new=1,
                   log=lines.append)
    assert lines == ["answering held-out problems 1-2 of 3 ...",
                     "answering held-out problems 3-3 of 3 ..."]


def _fake_training(monkeypatch: pytest.MonkeyPatch) -> list[TrainSettings]:
    """train_tiny without the training: a fresh model and a report of one step."""
    import dsv4_train.train as train

    seen: list[TrainSettings] = []

    def fake(settings: TrainSettings, cfg: Any = None, log: Any = print) -> Any:
        seen.append(settings)
        report = {"steps": 1, "train_seconds": 0.1, "device_name": "cpu", "curve": [
            {"step": 1, "ce": 3.0, "indexer_kl": 0.5, "phase_id": 0}],
            "evals": [{"step": 1, "accuracy": 0.0}],
            "heldout_accuracy_checkpoint_numerics": 0.0}
        return TrainLM(TinyLMConfig.preset()), report

    monkeypatch.setattr(train, "train_tiny", fake)
    return seen


def _modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}


def test_train_tiny_writes_a_whole_folder_and_replaces_only_its_own(tmp_path, monkeypatch,
                                                                    capsys):
    seen = _fake_training(monkeypatch)
    out = tmp_path / "model"
    old = os.umask(0o022)
    try:
        assert main(["train-tiny", "--out", str(out), "--seconds", "1", "--device", "cpu"]) == 0
    finally:
        os.umask(old)
    assert seen[0].seconds == 1.0
    assert sorted(p.name for p in out.iterdir()) == sorted(TINY_LM_FILES)
    assert set(_modes(out).values()) == {0o644}  # one shard used to come out 0600
    saved = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["saved"]
    assert all(Path(f).is_file() for f in saved)
    load_tiny_lm(out)
    (out / "train_report.json").write_text("{}")  # a tiny-LM folder: replaced whole
    assert main(["train-tiny", "--out", str(out), "--seconds", "1", "--device", "cpu"]) == 0
    assert json.loads((out / "train_report.json").read_text())["steps"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary folder left


def test_save_tiny_lm_refuses_a_folder_with_other_files(tmp_path):
    cfg = TinyLMConfig.preset()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"holds entries that are not tiny-LM files: "
                       r"\['notes.txt'\]"):
        save_tiny_lm(TrainLM(cfg).export_tensors(fp8=True), cfg, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_save_tiny_lm_gives_every_file_the_umask_mode(tmp_path):
    cfg = TinyLMConfig.preset()
    old = os.umask(0o027)
    try:
        save_tiny_lm(TrainLM(cfg).export_tensors(fp8=True), cfg, tmp_path / "m")
    finally:
        os.umask(old)
    assert set(_modes(tmp_path / "m").values()) == {0o640}
    load_tiny_lm(tmp_path / "m")
