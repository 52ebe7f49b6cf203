"""The in-process launcher: real torch.distributed ranks from a Python call, bounded in time.

`run(world_size, fn, *args)` starts ``world_size`` processes with
``torch.multiprocessing.start_processes`` ("forkserver" by default: forked
from a clean server that imported torch once; "spawn" also works), joins them
into one process group over TCP on 127.0.0.1 (a free port picked at launch),
calls ``fn(rank, world_size, *args)`` in each and returns the ranks' return
values in rank order. torch's process context does the rest: a rank that
raises ends the run (its traceback in the error), the others are terminated.
The whole run is bounded by ``timeout_s``. Results travel back as pickles in a
temporary directory (a pipe would fill up and block the rank).

The standard launcher is torchrun (``python -m torch.distributed.run
--nproc_per_node=R -m <your module>``): the same ranks, from the environment
(``current_device`` reads ``TORCH_REF_DEVICE`` there).

`one_cpu_thread` runs a block on one intra-op thread (tiny models on small hosts).

Devices: ``device="cpu"`` (default, ``backend="gloo"``) or ``device="cuda"``
(rank r uses ``cuda:(r % device_count)``; ``backend="nccl"`` with one GPU per
rank, gloo accepts CUDA tensors). ``fn`` and ``args`` must be picklable
(``fn`` a module-level function).

Example (``torch_ref/ddp_test.py`` runs one like it on two gloo ranks)::

    def rank_of(rank, world_size):  # module level: it is pickled to each rank
        return rank

    run(2, rank_of)  # -> [0, 1]
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing
import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server. DistributedDataParallel's constructor
# imports torch._dynamo (~6 s of CPU), so it is preloaded too.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "torch_ref",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Runs the body with ``torch.set_num_threads(1)``, restoring the count after.

    A tiny model is far too small for intra-op parallelism; on some hosts
    (e.g. sandboxed 2-core VMs) OpenMP synchronization makes every op ~500x
    slower with 2 threads than with 1. Results do not depend on it beyond
    float32 rounding.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def current_device() -> torch.device:
    """The device this rank should use (``run``'s ``device``; torchrun: ``TORCH_REF_DEVICE``)."""
    name = os.environ.get("TORCH_REF_DEVICE", "cpu")
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def run(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    device: str = "cpu",
    timeout_s: float = 120.0,
    start_method: str = "forkserver",
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` real processes.

    Args:
      world_size: number of ranks (>= 1).
      fn: a module-level function; its return value must be picklable.
      *args: picklable arguments passed to every rank.
      backend: "gloo" (CPU, or CUDA tensors) or "nccl" (one GPU per rank).
      device: "cpu" or "cuda"; visible to ``fn`` via `current_device()`.
      timeout_s: wall-clock bound of the whole run, start-up included; also the
        process-group timeout of every collective.
      start_method: "forkserver" (ranks forked from a server process that
        pre-imported torch: fresh interpreters that never saw the caller's
        state, e.g. JAX threads) or "spawn" (a fresh interpreter per rank).

    Returns:
      [result of rank 0, ..., result of rank world_size - 1].

    Raises:
      RuntimeError: a rank raised (its traceback is in the message), died, or
        the run exceeded ``timeout_s`` (all processes are stopped first).
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    with tempfile.TemporaryDirectory(prefix="torch_ref_ddp_") as out_dir:
        if start_method == "forkserver":
            # Every rank is a cheap fork of a server that imported torch once
            # (a cold `import torch` costs ~3 s of CPU per rank).
            multiprocessing.set_forkserver_preload(_PRELOAD)
        context = mp.start_processes(
            _rank_main,
            args=(world_size, free_port(), backend, device, timeout_s, out_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=5):
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"torch_ref.ddp.run: {world_size} ranks did not finish within "
                        f"timeout_s={timeout_s}"
                    )
        except mp.ProcessRaisedException as e:
            raise RuntimeError(f"torch_ref.ddp.run: a rank failed:\n{e}") from None
        except mp.ProcessExitedException as e:
            raise RuntimeError(f"torch_ref.ddp.run: a rank died: {e}") from None
        finally:
            _stop(context.processes)
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    device: str,
    timeout_s: float,
    out_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    """One rank: join the process group, call ``fn``, pickle its result into ``out_dir``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_REF_DEVICE=device)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # R ranks share the host's cores
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
    finally:
        # a DistributedDataParallel left in reference cycles would be freed at exit, after
        # the group: torch 2.13 then aborts the rank ("terminate called without an active
        # exception", 1 run in ~15 under load); freed here, while the group lives
        gc.collect()
        dist.destroy_process_group()
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)


def _stop(processes: list[multiprocessing.Process]) -> None:
    """Terminates (then kills) those of our own ranks still alive, by handle."""
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
