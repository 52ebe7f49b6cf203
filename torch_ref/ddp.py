"""A bounded launcher for real multi-process torch.distributed runs.

`run(world_size, fn, *args)` spawns ``world_size`` fresh Python processes
(``torch.multiprocessing``, "forkserver" by default: forked from a clean
server process that imported torch once; "spawn" also works), joins them into one process group over
TCP on 127.0.0.1 (a free port picked at launch), calls
``fn(rank, world_size, *args)`` in each, and returns the list of the ranks'
return values (rank order). Results travel back as pickles in a temporary
directory; the whole run is bounded by ``timeout_s``: on expiry (or when one
rank fails) the remaining processes are terminated and an error is raised.

Devices: ``device="cpu"`` (default, ``backend="gloo"``) or ``device="cuda"``
(rank r uses ``cuda:(r % device_count)``; use ``backend="nccl"`` when there is
one GPU per rank; NCCL refuses two ranks on one GPU, gloo accepts CUDA tensors).
``fn`` must be importable by name (a module-level function), and so must
everything in ``args`` (they are pickled to the children).

Example:
    >>> def hello(rank, world_size):
    ...     return rank * 10
    >>> run(2, hello)          # doctest: +SKIP
    [0, 10]
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
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


def current_device() -> torch.device:
    """The device this rank should use (set by `run` from its ``device`` argument)."""
    name = os.environ.get("TORCH_REF_DEVICE", "cpu")
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def _worker(
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
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCH_REF_DEVICE"] = device
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # R ranks share the host's cores
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        try:
            payload = ("ok", fn(rank, world_size, *args))
        except BaseException:  # noqa: BLE001 - shipped to the parent, then re-raised
            payload = ("error", traceback.format_exc())
        with open(os.path.join(out_dir, f"rank{rank}.tmp"), "wb") as f:
            pickle.dump(payload, f)
        os.replace(
            os.path.join(out_dir, f"rank{rank}.tmp"), os.path.join(out_dir, f"rank{rank}.pkl")
        )
    finally:
        dist.destroy_process_group()


def _errors_so_far(out_dir: str, world_size: int) -> str:
    """Tracebacks already written by ranks that failed (to explain a hang)."""
    found = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                found.append(f"\nrank {rank} raised:\n{value}")
    return "".join(found)


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
      fn: module-level function; its return value must be picklable.
      *args: picklable arguments passed to every rank.
      backend: "gloo" (CPU, or CUDA tensors) or "nccl" (one GPU per rank).
      device: "cpu" or "cuda"; visible to ``fn`` via `current_device()`.
      timeout_s: wall-clock bound of the whole run, start-up included; also the
        process-group timeout of every collective.
      start_method: "forkserver" (default: ranks are forked from a server
        process that pre-imported torch, fresh interpreters that never saw the
        caller's state, e.g. JAX threads) or "spawn" (a fresh interpreter per rank).

    Returns:
      [result of rank 0, ..., result of rank world_size - 1].

    Raises:
      RuntimeError: a rank raised (its traceback is in the message), died, or
        the run exceeded ``timeout_s`` (all processes are terminated first).
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    with tempfile.TemporaryDirectory(prefix="torch_ref_ddp_") as out_dir:
        if start_method == "forkserver":
            # The fork server imports torch once; every later rank is a cheap
            # fork of it (a cold `import torch` costs ~3 s of CPU per rank).
            multiprocessing.set_forkserver_preload(_PRELOAD)
        ctx = mp.start_processes(
            _worker,
            args=(world_size, free_port(), backend, device, timeout_s, out_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"torch_ref.ddp.run: {world_size} ranks did not finish within "
                        f"timeout_s={timeout_s}" + _errors_so_far(out_dir, world_size)
                    )
        except mp.ProcessRaisedException as e:
            raise RuntimeError(f"torch_ref.ddp.run: a rank failed:\n{e}") from None
        except mp.ProcessExitedException as e:
            raise RuntimeError(f"torch_ref.ddp.run: a rank died: {e}") from None
        finally:
            for proc in ctx.processes:  # only our own children, by handle
                if proc.is_alive():
                    proc.terminate()
            for proc in ctx.processes:
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5)
        results = []
        errors = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if errors:
            raise RuntimeError("torch_ref.ddp.run: fn raised\n" + "\n".join(errors))
        return results
