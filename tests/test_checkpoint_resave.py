"""save_checkpoint replaces a folder's checkpoint completely or not at all; partial stacks load
back with defaults; load_checkpoint's layer list and folder argument give clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

import dsv4.checkpoint as ckpt
from dsv4 import (
    AttentionStack,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from dsv4.platforms import build_attention
from dsv4.testing.random_weights import random_layer_weights


def make_stack(cfg, seed, ids=None):
    layers = {}
    for i in ids if ids is not None else range(cfg.num_layers_with_mtp):
        m = build_attention(cfg, i)
        m.load_weights(random_layer_weights(cfg, i, seed=seed).items())
        layers[i] = m
    return AttentionStack(cfg, layers)


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8))
        if sa[k].element_size() == 1 else torch.equal(sa[k], sb[k]) for k in sa)


def listing(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("first,second", [(200_000, 4 << 30), (200_000, 300_000),
                                          (4 << 30, 200_000)])
def test_resave_leaves_exactly_the_new_checkpoint(tmp_path, tiny, first, second):
    old, new = make_stack(tiny, 1), make_stack(tiny, 2)
    folder = tmp_path / "ckpt"
    save_checkpoint(old, folder, max_shard_bytes=first)
    files = save_checkpoint(new, folder, max_shard_bytes=second)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left behind
    loaded = load_checkpoint(folder)
    for i in new.layer_ids:
        assert same_weights(loaded[i], new[i]), i


def test_failed_save_leaves_the_previous_checkpoint(tmp_path, tiny, monkeypatch):
    folder = tmp_path / "ckpt"
    save_checkpoint(make_stack(tiny, 1), folder, max_shard_bytes=200_000)
    before = listing(folder)
    real = ckpt.save_file
    calls = []

    def failing(tensors, path, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(tensors, path, **kw)

    monkeypatch.setattr(ckpt, "save_file", failing)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(make_stack(tiny, 2), folder, max_shard_bytes=300_000)
    assert listing(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_failed_first_save_creates_nothing(tmp_path, tiny, monkeypatch):
    def failing(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "save_file", failing)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(make_stack(tiny, 1, [0]), tmp_path / "new")
    assert list(tmp_path.iterdir()) == []


def test_folder_with_foreign_files_is_refused_untouched(tmp_path, tiny):
    folder = tmp_path / "ckpt"
    save_checkpoint(make_stack(tiny, 1, [0]), folder)
    (folder / "notes.txt").write_text("mine")
    (folder / "sub").mkdir()
    names = sorted(p.name for p in folder.iterdir())
    with pytest.raises(CheckpointError, match=r"not checkpoint files: \['notes.txt', 'sub'\]"):
        save_checkpoint(make_stack(tiny, 2, [0]), folder)
    assert sorted(p.name for p in folder.iterdir()) == names
    assert (folder / "notes.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="is a file, not a folder"):
        save_checkpoint(make_stack(tiny, 2, [0]), folder / "notes.txt")


def test_saved_files_get_the_umask_permissions(tmp_path, tiny):
    old = os.umask(0o022)
    try:
        files = save_checkpoint(make_stack(tiny, 1), tmp_path / "a", max_shard_bytes=200_000)
        (tmp_path / "plain").write_text("x")
        want = (tmp_path / "plain").stat().st_mode & 0o777
        assert {p.name: p.stat().st_mode & 0o777 for p in files} == {p.name: want for p in files}
        os.umask(0o077)
        files = save_checkpoint(make_stack(tiny, 1, [0]), tmp_path / "b")
        assert {p.stat().st_mode & 0o777 for p in files} == {0o600}
        assert (tmp_path / "b").stat().st_mode & 0o777 == 0o700
    finally:
        os.umask(old)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o755


def test_partial_stack_loads_back_with_defaults(tmp_path, tiny):
    full = tmp_path / "full"
    save_checkpoint(make_stack(tiny, 3), full)
    part = load_checkpoint(full, layers=[2, 0])
    save_checkpoint(part, tmp_path / "part")
    saved = json.loads((tmp_path / "part" / "config.json").read_text())
    assert saved[ckpt.SAVED_LAYERS_KEY] == [0, 2]
    back = load_checkpoint(tmp_path / "part")
    assert back.layer_ids == [0, 2]
    assert all(same_weights(back[i], part[i]) for i in (0, 2))


@pytest.mark.parametrize("layers,match", [
    ([1, 1], r"duplicate layer id\(s\) \[1\]"),
    ([0, 2, 0, 2], r"duplicate layer id\(s\) \[0, 2\]"),
    ([], r"layers=\[\]: give at least one layer id"),
    (["1"], r"layer ids must be integers, got \['1'\]"),
    ("01", r"give a list of layer ids"),
])
def test_bad_layer_lists_are_clear_errors(tmp_path, tiny, layers, match):
    save_checkpoint(make_stack(tiny, 1, [0, 1]), tmp_path)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(tmp_path, layers=layers)


def test_a_file_is_not_a_checkpoint_folder(tmp_path, tiny):
    save_checkpoint(make_stack(tiny, 1, [0]), tmp_path)
    with pytest.raises(CheckpointError, match=r"model.safetensors is a file, not a checkpoint "
                                              "folder"):
        load_checkpoint(tmp_path / "model.safetensors")
