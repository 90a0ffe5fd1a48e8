"""Start a tensor-parallel job: N fresh processes with a process group each, or the processes
``torchrun`` started (``WORLD_SIZE`` set).

Every process gets NVLink multicast switched off (:data:`NO_MULTICAST_ENV`, required on the lent
GPU machines), a process group with a bounded timeout (:data:`DEFAULT_TIMEOUT_S`), and on CUDA the
GPU of its local rank. Results come back as one pickle file per rank, so a large result never
blocks a pipe.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_TIMEOUT_S = 60.0
"""Seconds any collective may wait for the other ranks before it raises."""

Worker = Callable[..., Any]
"""``fn(group, *args) -> result``: runs on every rank with the initialised process group."""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher setting
    ``WORLD_SIZE``)."""
    return "WORLD_SIZE" in os.environ


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@contextmanager
def no_multicast_env() -> Iterator[None]:
    """Set :data:`NO_MULTICAST_ENV` in ``os.environ`` (inherited by spawned children), then
    restore what was there."""
    old = {k: os.environ.get(k) for k in NO_MULTICAST_ENV}
    os.environ.update(NO_MULTICAST_ENV)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _init(backend: str, rank: int, world: int, init_method: str, timeout_s: float) -> Any:
    os.environ.update(NO_MULTICAST_ENV)  # NCCL reads them when the communicator starts
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.group.WORLD


def _entry(rank: int, fn: Worker, world: int, port: int, backend: str, timeout_s: float,
           args: tuple[Any, ...], out_dir: str) -> None:
    if backend == "gloo":  # CPU ranks share the cores: one thread each, or they spin on each other
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    _init(backend, rank, world, f"tcp://127.0.0.1:{port}", timeout_s)
    try:
        result = fn(dist.group.WORLD, *args)
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
        dist.barrier()  # every rank's result is on disk
    except BaseException:
        dist.destroy_process_group()
        raise  # mp.spawn reports the traceback
    # A spawned rank whose result is saved leaves without the process group's C++ teardown: rank 0
    # hosts the rendezvous store, and a rank whose background threads still talk to it while it
    # goes away aborts at exit ("terminate called without an active exception", SIGABRT; seen on a
    # busy 2-core CI machine even after a barrier). Nothing is lost: the result file is closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Worker, world: int, args: tuple[Any, ...] = (), backend: str = "gloo",
          timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(group, *args)`` in ``world`` new processes (ranks 0 .. world - 1, rendezvous on a
    free local port) and return their results by rank. ``fn`` must be importable (a module-level
    function). A rank that raises makes this raise (with its traceback)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise RuntimeError(f"{world} NCCL ranks need {world} GPUs; this machine has "
                           f"{torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="dsv4-tp-") as out, no_multicast_env():
        mp.spawn(_entry, args=(fn, world, free_port(), backend, timeout_s, args, out),
                 nprocs=world, join=True)
        results = []
        for r in range(world):
            with open(Path(out) / f"rank{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
    return results


def run_here(fn: Worker, args: tuple[Any, ...] = (), backend: str = "gloo",
             timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Under ``torchrun``: initialise this rank's process group from the environment, run
    ``fn(group, *args)`` and return this rank's result."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _init(backend, rank, world, "env://", timeout_s)
    try:
        return fn(dist.group.WORLD, *args)
    finally:
        dist.destroy_process_group()
