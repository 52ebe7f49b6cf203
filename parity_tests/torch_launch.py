"""The standard launcher: ``torchrun -m parity_tests.torch_launch SCENARIO.npz RESULT.npz``.

A caller saves a `Scenario` (`save_scenario`), launches the ranks the usual way::

    torchrun --nproc_per_node=2 -m parity_tests.torch_launch scenario.npz result.npz
    python -m torch.distributed.run --nproc_per_node=2 -m parity_tests.torch_launch \
        scenario.npz result.npz
    python -m parity_tests.torch_launch scenario.npz result.npz  # world size 1, no group

and reads the `ScenarioResult` back (`load_result`). Every rank runs
`parity_tests.torch_ranks.run_on_rank`, the function the in-process launcher
(`parity_tests.torch_ranks.run_scenarios`) runs; rank 0 gathers every rank's
records and writes the file. The process group comes from torchrun's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ...).

Files are ``.npz`` without pickles: the arrays (weights, micro-batches,
parameters, gradients) as named entries, everything else as one JSON string
(``"scenario.json"`` or ``"result.json"``; NaN and inf as JSON's ``NaN`` and
``Infinity``, as Python's json writes them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from parity_tests.torch_ranks import run_on_rank
from parity_tests.torch_scenario import SGD, AdamW, Scenario, ScenarioResult, WarmupCosine
from tinygpt import TinyGPTConfig
from torch_ref import ddp
from torch_ref.ddp import one_cpu_thread

_KEYS = ("input_ids", "labels")


def save_scenario(path: str | os.PathLike, scenario: Scenario) -> None:
    """Writes ``scenario`` to an ``.npz`` file (`load_scenario` reads it back)."""
    settings = {f.name: getattr(scenario, f.name) for f in dataclasses.fields(scenario)}
    del settings["weights"], settings["windows"]
    settings["config"] = dataclasses.asdict(scenario.config)
    settings["optimizer"] = {
        "type": type(scenario.optimizer).__name__,
        **dataclasses.asdict(scenario.optimizer),
    }
    schedule = scenario.schedule
    settings["schedule"] = dataclasses.asdict(schedule) if schedule is not None else None
    settings["inf_microbatches"] = sorted(scenario.inf_microbatches)
    settings["layout"] = [[len(rank) for rank in window] for window in scenario.windows]
    arrays = {f"weights/{n}": np.asarray(a) for n, a in scenario.weights.items()}
    for u, window in enumerate(scenario.windows):
        for r, rank in enumerate(window):
            for m, mb in enumerate(rank):
                arrays.update({f"windows/{u}/{r}/{m}/{key}": np.asarray(mb[key]) for key in _KEYS})
    np.savez(path, **{"scenario.json": np.array(json.dumps(settings))}, **arrays)


def load_scenario(path: str | os.PathLike) -> Scenario:
    """The `Scenario` written by `save_scenario`."""
    with np.load(path, allow_pickle=False) as f:
        settings = json.loads(str(f["scenario.json"]))
        weights = {k.split("/", 1)[1]: f[k] for k in f.files if k.startswith("weights/")}
        layout = settings.pop("layout")
        windows = [
            [
                [{key: f[f"windows/{u}/{r}/{m}/{key}"] for key in _KEYS} for m in range(k)]
                for r, k in enumerate(window)
            ]
            for u, window in enumerate(layout)
        ]
    optimizer = settings.pop("optimizer")
    kind = {"AdamW": AdamW, "SGD": SGD}[optimizer.pop("type")]
    if "betas" in optimizer:
        optimizer["betas"] = tuple(optimizer["betas"])
    schedule = settings.pop("schedule")
    return Scenario(
        config=TinyGPTConfig(**settings.pop("config")),
        weights=weights,
        windows=windows,
        optimizer=kind(**optimizer),
        schedule=WarmupCosine(**schedule) if schedule else None,
        inf_microbatches=frozenset(tuple(x) for x in settings.pop("inf_microbatches")),
        **settings,
    )


def save_result(path: str | os.PathLike, result: ScenarioResult) -> None:
    """Writes ``result`` to an ``.npz`` file (`load_result` reads it back)."""
    meta = {
        "records": result.records,
        "rank_records": result.rank_records,
        "comm": result.comm,
        "windows": len(result.params),
        "grads": result.grads is not None,
    }
    arrays = {}
    for kind, snapshots in (("params", result.params), ("grads", result.grads or [])):
        for u, tensors in enumerate(snapshots):
            arrays.update({f"{kind}/{u}/{n}": a for n, a in tensors.items()})
    np.savez(path, **{"result.json": np.array(json.dumps(meta))}, **arrays)


def load_result(path: str | os.PathLike) -> ScenarioResult:
    """The `ScenarioResult` written by `save_result` (parameter names in file order)."""
    with np.load(path, allow_pickle=False) as f:
        meta = json.loads(str(f["result.json"]))

        def snapshots(kind: str) -> list[dict[str, np.ndarray]]:
            found: list[dict[str, np.ndarray]] = [{} for _ in range(meta["windows"])]
            for key in f.files:
                if key.startswith(kind + "/"):
                    _, u, name = key.split("/", 2)
                    found[int(u)][name] = f[key]
            return found

        return ScenarioResult(
            records=meta["records"],
            params=snapshots("params"),
            grads=snapshots("grads") if meta["grads"] else None,
            comm=meta["comm"],
            rank_records=meta["rank_records"],
        )


TORCHRUN_ENV: Mapping[str, str] = MappingProxyType(
    {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
)
"""Environment for `torchrun_command` on one host: gloo on the loopback, one thread per rank."""
TORCHRUN_TIMEOUT_S = 240.0
"""A bound on a `torchrun_command` launch of a few tiny windows on a busy 2-core host (start-up
alone: ~10 s of CPU per rank); its collectives time out at half of it, so a hung one is named."""


def torchrun_command(scenario: str | os.PathLike, result: str | os.PathLike) -> list[str]:
    """The command that runs a saved scenario on two local ranks under torchrun.

    ``--standalone``: torchrun's agent binds its store on a port the OS picks
    (port 0) and holds it; a port picked here would be released, then bound by
    torchrun later, and another job may take it in between.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    cmd += ["--standalone", "--local-addr=127.0.0.1", "-m", "parity_tests.torch_launch"]
    return cmd + [os.fspath(scenario), os.fspath(result), f"--timeout-s={TORCHRUN_TIMEOUT_S / 2}"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one rank of a saved scenario (all of them under torchrun); rank 0 writes the result.

    Args:
      argv: ``SCENARIO.npz RESULT.npz [--device cpu|cuda] [--backend B] [--timeout-s S]``.

    Returns:
      0 (an error raises, and torchrun reports the failing rank).
    """
    parser = argparse.ArgumentParser(
        prog="python -m parity_tests.torch_launch", description=main.__doc__
    )
    parser.add_argument("scenario", help="a file written by save_scenario")
    parser.add_argument("result", help="where rank 0 writes the ScenarioResult (.npz)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", default=None, help="default: gloo on CPU, nccl on CUDA")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    args = parser.parse_args(argv)
    scenario = load_scenario(args.scenario)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ["TORCH_REF_DEVICE"] = args.device
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if world_size == 1:
        with one_cpu_thread():
            result = run_on_rank(scenario, 0, 1, ddp.current_device())
        save_result(args.result, result)
        return 0
    torch.set_num_threads(1)  # the ranks share the host's cores
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    with ddp.process_group(backend, args.timeout_s):  # left before the interpreter exits
        result = run_on_rank(scenario, rank, world_size, ddp.current_device())
        every_rank: list[Any] = [None] * world_size
        dist.all_gather_object(every_rank, result.records)
    if rank == 0:
        result.rank_records = every_rank
        save_result(args.result, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
