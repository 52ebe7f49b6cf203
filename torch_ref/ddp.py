"""The in-process launcher: real torch.distributed ranks from a Python call, bounded in time.

`run(world_size, fn, *args)` starts ``world_size`` processes with
``torch.multiprocessing.start_processes`` ("forkserver" by default: forked
from a clean server that imported torch once; "spawn" also works), joins them
into one process group (`process_group`, which frees it after), calls
``fn(rank, world_size, *args)`` in each and returns the ranks' return values in
rank order, all within ``timeout_s``.
``fn``, ``args`` and the results travel as pickles in a temporary directory (a
pipe would fill up and block the rank): each rank unpickles its own copy.

The rendezvous guesses no free port: this process serves the group's
``TCPStore`` on 127.0.0.1 on a port the OS picks as it binds (port 0), held
until the run ends; the ranks are its clients. (A port picked, released and
bound again by rank 0 could be taken by another job in between.)

A failure says why: each rank's stderr (file descriptor 2: Python, native code,
``faulthandler``'s stacks on a crash) goes to a file, copied to this process's
stderr after the run. The ``RuntimeError`` of a rank that raised, died (an exit
code, a signal) or hung past ``timeout_s`` holds its traceback (a hung rank's
Python stack) and the last `STDERR_LINES` lines of every rank's stderr.

The standard launcher is torchrun (``python -m torch.distributed.run
--nproc_per_node=R -m <your module>``): the same ranks, from the environment
(``current_device`` reads ``TORCH_REF_DEVICE`` there); a rank of `run` has
torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` too.

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
import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torch_ref._process_group import process_group

HOST = "127.0.0.1"
STDERR_LINES = 30
"""How many of each rank's last stderr lines an error shows."""
# Imported once by the fork server. DistributedDataParallel's constructor
# imports torch._dynamo (~6 s of CPU), so it is preloaded too.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
    "torch_ref",
]
# A hung rank prints its stacks on this signal (faulthandler), before it is stopped.
_DUMP_STACKS = signal.SIGUSR1


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
      *args: picklable arguments; every rank unpickles its own copy.
      backend: "gloo" (CPU, or CUDA tensors) or "nccl" (one GPU per rank).
      device: "cpu" or "cuda"; visible to ``fn`` via `current_device()`.
      timeout_s: wall-clock bound of the whole run, start-up included; also the
        process-group timeout of every collective and of the rendezvous.
      start_method: "forkserver" (ranks forked from a server process that
        pre-imported torch: fresh interpreters that never saw the caller's
        state, e.g. JAX threads) or "spawn" (a fresh interpreter per rank).

    Returns:
      [result of rank 0, ..., result of rank world_size - 1].

    Raises:
      RuntimeError: a rank raised, died (an exit code or a signal), or the run
        exceeded ``timeout_s`` (all processes are stopped first); the message
        holds the traceback (or the hung ranks' stacks) and every rank's last
        stderr lines.
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    _check_main_module()
    with tempfile.TemporaryDirectory(prefix="torch_ref_ddp_") as out_dir:
        _dump(os.path.join(out_dir, "call.pkl"), (fn, args))
        if start_method == "forkserver":
            # Every rank is a cheap fork of a server that imported torch once
            # (a cold `import torch` costs ~3 s of CPU per rank).
            multiprocessing.set_forkserver_preload(_PRELOAD)
        timeout = datetime.timedelta(seconds=timeout_s)
        # Bound to a port the OS picks, held until the run ends: no other job can take it.
        store = dist.TCPStore(HOST, 0, None, True, timeout, wait_for_workers=False)
        context = mp.start_processes(
            _rank_main,
            args=(world_size, store.port, backend, device, timeout_s, out_dir),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        try:
            _join(context, timeout_s, out_dir)
        finally:
            _stop(context.processes)
            del store  # held to the end
            for rank in range(world_size):
                sys.stderr.write(_read(_stderr_path(out_dir, rank)))
        return [_load(os.path.join(out_dir, f"rank{rank}.pkl")) for rank in range(world_size)]


def _check_main_module() -> None:
    """Refuses a main module the ranks cannot import: multiprocessing imports it in each."""
    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is None and path is not None:
        path = os.path.join(multiprocessing.process.ORIGINAL_DIR or "", path)
        if not os.path.isfile(path):
            raise RuntimeError(
                f"torch_ref.ddp.run: the ranks import this program's main module and {path!r}"
                " is not a file (a program read from stdin?): run it from a file, a module"
                " (python -m) or python -c"
            )


def _join(context: mp.ProcessContext, timeout_s: float, out_dir: str) -> None:
    """Waits for the ranks; a failure or the deadline raises the error that says why."""
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=5):
            if time.monotonic() >= deadline:
                hung = _dump_stacks(context.processes)
                raise RuntimeError(
                    f"torch_ref.ddp.run: ranks {hung} of {len(context.processes)} did not finish"
                    f" within timeout_s={timeout_s}; their Python stacks are in their stderr"
                    + _stderr_tails(out_dir, len(context.processes))
                )
    except mp.ProcessRaisedException as e:
        raise RuntimeError(
            f"torch_ref.ddp.run: rank {e.error_index} failed:{e.msg}"
            + _stderr_tails(out_dir, len(context.processes))
        ) from None
    except mp.ProcessExitedException as e:
        raise RuntimeError(
            f"torch_ref.ddp.run: rank {e.error_index} died: {e.msg}, without a traceback (an"
            " exit outside fn's exceptions, a signal, a crash in native code, or multiprocessing"
            " failing to start it; SIGKILL is often the out-of-memory killer)"
            + _stderr_tails(out_dir, len(context.processes))
        ) from None


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    device: str,
    timeout_s: float,
    out_dir: str,
) -> None:
    """One rank: stderr to its file, join the group, call ``fn``, pickle its result."""
    stderr = open(_stderr_path(out_dir, rank), "ab", buffering=0)  # noqa: SIM115 (to the exit)
    os.dup2(stderr.fileno(), 2)  # Python's sys.stderr and native code's writes alike
    faulthandler.enable(file=stderr)  # a crash prints every thread's Python stack
    faulthandler.register(_DUMP_STACKS, file=stderr)
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), TORCH_REF_DEVICE=device)
    # and torchrun's: accelerate and transformers read the rank there, not in the group
    ranks = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world_size, LOCAL_WORLD_SIZE=world_size)
    os.environ.update({name: str(value) for name, value in ranks.items()})
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # R ranks share the host's cores
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    fn, args = _load(os.path.join(out_dir, "call.pkl"))
    store = dist.TCPStore(HOST, port, None, False, datetime.timedelta(seconds=timeout_s))
    with process_group(backend, timeout_s, store=store, rank=rank, world_size=world_size):
        result = fn(rank, world_size, *args)
    _dump(os.path.join(out_dir, f"rank{rank}.pkl"), result)


def _dump(path: str, value: Any) -> None:
    """Pickles ``value`` to ``path`` atomically (a reader never sees half a file)."""
    with open(path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(path + ".tmp", path)


def _load(path: str) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def _stderr_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.stderr")


def _read(path: str) -> str:
    """The file's text ('' when there is none)."""
    with contextlib.suppress(FileNotFoundError), open(path, errors="replace") as f:
        return f.read()
    return ""


def _stderr_tails(out_dir: str, world_size: int) -> str:
    """Every rank's last `STDERR_LINES` stderr lines, as sections of an error message."""
    sections = []
    for rank in range(world_size):
        path = _stderr_path(out_dir, rank)
        if not os.path.exists(path):
            sections.append(
                f"\n\n-- rank {rank}'s stderr: none, it ended before torch_ref.ddp's code ran in"
                " it (while multiprocessing started it: its traceback, if any, is in this"
                " process's stderr; a script that starts ranks from its top level needs"
                " `if __name__ == '__main__':` around that code, since each rank imports the"
                " script again) --"
            )
            continue
        lines = _read(path).splitlines()
        shown = f"last {STDERR_LINES} of {len(lines)}" if len(lines) > STDERR_LINES else "all"
        body = "\n".join(lines[-STDERR_LINES:]) if lines else "(empty)"
        sections.append(f"\n\n-- rank {rank}'s stderr ({shown} lines) --\n{body}")
    return "".join(sections)


def _dump_stacks(processes: list[multiprocessing.Process]) -> list[int]:
    """Asks the ranks still alive for their stacks (into their stderr); their ranks."""
    hung = [rank for rank, proc in enumerate(processes) if proc.is_alive()]
    for rank in hung:
        with contextlib.suppress(ProcessLookupError):
            os.kill(processes[rank].pid, _DUMP_STACKS)
    time.sleep(1.0)  # a second for them to write (faulthandler's handler is native code)
    return hung


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
