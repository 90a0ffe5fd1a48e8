"""Shared fixtures: the tiny preset, loaded layers, fresh random inputs."""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Callable

import pytest
import torch

from dsv4 import DeepseekV4Attention, DSV4Config
from dsv4.kernels.fused_input_proj import _INTERPRET, triton_available
from dsv4.platforms import build_attention
from dsv4.testing.random_weights import random_layer_weights

RATIOS = (0, 4, 128)

# Triton kernel tests: they run on a GPU, or on the CPU under Triton's interpreter
HAS_CUDA = torch.cuda.is_available()
kernel_runs = pytest.mark.skipif(
    not (triton_available() and (_INTERPRET or HAS_CUDA)),
    reason="needs Triton with a CUDA GPU or TRITON_INTERPRET=1")
needs_gpu = pytest.mark.skipif(not (HAS_CUDA and triton_available() and not _INTERPRET),
                               reason="needs a CUDA GPU and Triton (not the interpreter)")
KERNEL_DEV = "cuda" if HAS_CUDA and not _INTERPRET else "cpu"
"""Where the kernel tests put their tensors."""


FIRST_GROUPS = ("tensor-parallel", "cli-usage")
"""pytest-xdist groups (``--dist loadgroup``, ``benchmarks/gpu_check.sh suite``) whose tests
are collected first, so that a worker starts each of them at once: in the GPU suite of
2026-12-08 (H100, 16 workers, ``benchmarks/results/2026-12-08-h100/gpu-tests/``) the TP=2
spawned job took 226 s on the worker that met it, and the suite's 288 s ended with it; the
command-line cases (one fixture that starts every case's process) ran it on each worker that
drew one of its tests, 372 s of worker time in all."""


def _xdist_group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return str(mark.args[0]) if mark is not None and mark.args else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The :data:`FIRST_GROUPS` first (in their order, the rest as collected); off a GPU, the
    ``cuda`` tests skipped."""
    items.sort(key=lambda item: FIRST_GROUPS.index(g) if (g := _xdist_group(item))
               in FIRST_GROUPS else len(FIRST_GROUPS))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


_IS_XDIST_WORKER = False


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's PyTorch takes its share of the cores, not all of them.
    With 15-16 workers of 16 threads each on a 16-core GPU machine, tests that take 1-17 s on a
    2-core machine (the rollback property test, the prefill bench's CPU rows, the plan tests)
    had not finished after 400-560 s (2026-12-06, `benchmarks/results/2026-12-06-h100/`)."""
    global _IS_XDIST_WORKER
    _IS_XDIST_WORKER = hasattr(config, "workerinput")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if _IS_XDIST_WORKER and workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """``DSV4_REPORT_DIR=DIR``: as each test phase is reported, its duration appended to
    ``DIR/durations.txt`` (seconds, phase, id) and a failure's traceback to
    ``DIR/failures.txt``. pytest prints both only when the whole run ends, which a run cut by a
    time limit (a lent GPU's call) never reaches. Written by the controlling process only."""
    folder = os.environ.get("DSV4_REPORT_DIR")
    if not folder or _IS_XDIST_WORKER:
        return
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "durations.txt"), "a") as f:
        f.write(f"{report.duration:9.2f} {report.when:8} {report.nodeid}\n")
    if report.failed:
        with open(os.path.join(folder, "failures.txt"), "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


TEST_SEED = int(os.environ.get("DSV4_TEST_SEED", "0"))
"""Varies every test's unseeded random inputs (``DSV4_TEST_SEED=N pytest``: another sweep)."""


@pytest.fixture(autouse=True)
def _seed_from_the_test_id(request: pytest.FixtureRequest) -> None:
    """Each test's global generators start from its own id (and DSV4_TEST_SEED), not from
    whatever the tests before it in this process drew: a failure reproduces when the test runs
    alone, in any order or worker."""
    seed = (zlib.crc32(request.node.nodeid.encode()) + 7919 * TEST_SEED) % 2**32
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture
def tiny() -> DSV4Config:
    return DSV4Config.preset("tiny")


@pytest.fixture
def tiny_exact() -> DSV4Config:
    """Tiny preset with the quantisation simulations off (what float64 comparisons use)."""
    return DSV4Config.preset("tiny").replace(simulate_quant=False)


LayerFactory = Callable[..., DeepseekV4Attention]


@pytest.fixture
def make_layer() -> LayerFactory:
    def make(cfg: DSV4Config, ratio: int, dtype: torch.dtype = torch.bfloat16,
             platform: str = "reference", seed: int = 0, **kw: object) -> DeepseekV4Attention:
        layer_id = cfg.layer_of_ratio(ratio)
        layer = build_attention(cfg, layer_id, platform=platform, dtype=dtype, **kw)
        layer.load_weights(random_layer_weights(cfg, layer_id, seed).items())
        return layer

    return make


def random_x(t: int, hidden: int, seed: int | None = None) -> torch.Tensor:
    """Fresh random activations, exactly representable in bf16 (so every dtype sees the same x)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    x = torch.randn(t, hidden, generator=g, dtype=torch.float64)
    return x.to(torch.bfloat16).to(torch.float64)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    return float((a64 - b64).norm() / b64.norm())


def assert_decode_graph_equals_eager(layer: DeepseekV4Attention, caches: list, x: torch.Tensor
                                     ) -> None:
    """One decode step of ``caches`` run eagerly and rolled back; then the same step captured
    by hand (:func:`dsv4.runner.captured_step`: over a plan made before the capture, as the
    decode runner captures it) and replayed: the replay equals the eager output bitwise, and
    the caches are as they were after. (A platform's own graphs of plain decode calls stay off
    meanwhile - :func:`~dsv4.testing.probes.eager_steps`: they replay padded steps, not this
    eager one.)"""
    from dsv4.runner import captured_step
    from dsv4.testing.probes import eager_steps

    pos = torch.tensor([c.length for c in caches])
    lengths = [c.length for c in caches]
    with eager_steps(layer):
        eager = layer(x, pos, caches)
        for c, n in zip(caches, lengths, strict=True):
            c.truncate(n)
        with captured_step(layer, caches, x) as (graph, out):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)
    assert [c.length for c in caches] == lengths


def layer_stack(cfg: DSV4Config, ratios: list[int], dtype: torch.dtype = torch.float64,
                platform: str = "reference", device: str = "cpu") -> list[DeepseekV4Attention]:
    """Layers 0 .. len(ratios) - 1 of ``cfg`` with that schedule of compress ratios (a model's
    stack, distinct layer ids), random weights seeded by layer."""
    c = cfg.replace(compress_ratios=tuple(ratios), num_hidden_layers=len(ratios))
    layers = []
    for i in range(len(ratios)):
        layer = build_attention(c, i, dtype=dtype, platform=platform, device=device)
        layer.load_weights(random_layer_weights(c, i, seed=i))
        layers.append(layer)
    return layers


def tanh_residual(layers: list[DeepseekV4Attention]) -> Callable[..., torch.Tensor]:
    """A model's step over ``layers``: residuals with a row-wise nonlinearity between them (the
    user's code between the layers), each layer taking its step from ``plan``."""
    def run(plan: object, x: torch.Tensor) -> torch.Tensor:
        for lay in layers:
            x = x + lay(torch.tanh(x), plan=plan)
        return x
    return run


class Twins:
    """The same sequences in several sets of pools (one per side), changed in lockstep: what a
    run and its reference share. ``live[side][i]``: sequence i's caches on that side."""

    def __init__(self, layers: list[DeepseekV4Attention], sides: str | tuple[str, ...],
                 max_seqs: int, max_seq_len: int, **pool_kwargs: object) -> None:
        self.layers = layers
        self.sides = tuple(sides)
        self.pools = {s: [lay.new_cache_pool(max_seqs, max_seq_len, **pool_kwargs)
                          for lay in layers] for s in self.sides}
        self.live: dict[str, list[list]] = {s: [] for s in self.sides}

    def __len__(self) -> int:
        return len(self.live[self.sides[0]])

    def join(self, x: torch.Tensor) -> None:
        """A new sequence on every side, prefilled with the rows of ``x`` (one plan)."""
        from dsv4.cache.plan import StepPlan

        for s in self.sides:
            seq = [p.add_sequence() for p in self.pools[s]]
            self.live[s].append(seq)
            with StepPlan([seq], [x.shape[0]]) as plan:
                tanh_residual(self.layers)(plan, x)

    def fork(self, i: int) -> None:
        for s in self.sides:
            self.live[s].append([c.fork() for c in self.live[s][i]])

    def leave(self, i: int) -> None:
        for s in self.sides:
            for c in self.live[s].pop(i):
                c.free()
