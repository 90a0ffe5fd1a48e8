"""What an installation holds: the shipped model as package data (in the wheel and the sdist,
found from any directory), the license, the version, docstrings on the public API."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import dsv4
from dsv4.tinylm.paths import default_model_dir

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILES = sorted(p.name for p in default_model_dir().iterdir())


def test_the_shipped_model_lives_in_the_package():
    folder = default_model_dir()
    assert folder.parent == Path(dsv4.__file__).resolve().parent / "tinylm"
    assert (folder / "config.json").is_file()
    assert {"config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"} <= set(MODEL_FILES)


def test_the_model_is_found_from_another_directory(tmp_path):
    code = "from dsv4.tinylm.paths import default_model_dir as d; print(d() / 'config.json')"
    # the package as this run imports it (installed, or a relative PYTHONPATH=src as on the GPU
    # machine, which the other directory would not resolve)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(dsv4.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True, env=env).stdout.strip()
    assert Path(out).is_file()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A wheel and an sdist of a copy of the project, built offline by setuptools' own backend
    (what pip runs without build isolation)."""
    pytest.importorskip("setuptools.build_meta")
    src = tmp_path_factory.mktemp("project")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src" / "dsv4", src / "src" / "dsv4",
                    ignore=shutil.ignore_patterns("__pycache__"))
    dist = src / "dist"
    code = ("from setuptools import build_meta as b; import sys; out = sys.argv[1]; "
            "b.build_wheel(out); b.build_sdist(out)")  # the backend rewrites sys.argv
    run = subprocess.run([sys.executable, "-c", code, str(dist)], cwd=src, capture_output=True,
                         text=True)
    if run.returncode != 0:
        pytest.skip(f"the build backend cannot build here: {run.stderr.strip()[-300:]}")
    return dist


def test_the_wheel_holds_the_model_and_the_license(built):
    wheel, = built.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.startswith("dsv4/tinylm/tiny-arith/")] == [
        f"dsv4/tinylm/tiny-arith/{f}" for f in MODEL_FILES]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA")))
    assert f"Version: {dsv4.__version__}" in meta.decode()


def test_the_sdist_holds_the_model(built):
    sdist, = built.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    root = sdist.name.removesuffix(".tar.gz")
    for f in MODEL_FILES:
        assert f"{root}/src/dsv4/tinylm/tiny-arith/{f}" in names
    assert f"{root}/LICENSE" in names


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_the_apache_2_text_pyproject_declares():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"


def test_the_version_has_one_source_and_the_command_prints_it(capsys):
    from dsv4.cli import main

    pyproject = _pyproject()
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dsv4.__version__"}
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"dsv4 {dsv4.__version__}\n"


def _public_api():
    from dsv4 import AttentionCache, CachePool, DeepseekV4Attention, DSV4Config

    return [DeepseekV4Attention, DeepseekV4Attention.__init__, dsv4.build_attention,
            DeepseekV4Attention.load_weights, DeepseekV4Attention.forward,
            AttentionCache.fork, AttentionCache.free, CachePool.reset, CachePool.read_rows,
            CachePool.held_bytes, CachePool.blocks_in_use, DSV4Config.replace,
            DSV4Config.validate, dsv4.load_checkpoint, dsv4.save_checkpoint]


@pytest.mark.parametrize("obj", _public_api(), ids=lambda o: o.__qualname__)
def test_the_public_api_has_docstrings(obj):
    doc = inspect.getdoc(obj)
    assert doc and len(doc.split()) >= 12, obj.__qualname__


def test_help_of_the_layer_explains_how_to_use_it():
    from dsv4 import DeepseekV4Attention

    doc = DeepseekV4Attention.__doc__ or ""
    for word in ("build_attention", "load_checkpoint", "load_weights", "new_cache", "Example"):
        assert word in doc, word
    init = inspect.getdoc(DeepseekV4Attention.__init__) or ""
    assert "placeholder weights" in init  # its own, not torch.nn.Module's
