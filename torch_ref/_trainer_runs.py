"""One trainer, one optimizer update, on given rows: in this process or on gloo ranks.

The audits of a Hugging Face trainer (`audit_hf_trainer`, `audit_trl_grpo`) all
run it the same way: build the trainer's arguments from settings (the class
named by ``args_class``, a temporary ``output_dir``), hand them to a picklable
factory that builds the trainer on a fresh copy of the model, train (the updates
the settings' ``max_steps`` says), and return rank 0's parameters and what the
trainer recorded (e.g. the rows each micro-batch read). Several runs on one
world size share one launch of the ranks (one start-up, imports included).

Nothing reaches the network: every run sets `OFFLINE` (``setdefault``) before
``transformers`` is imported, in this process and in each rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import importlib
import os
import random
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from torch_ref._audit_args import _parameters
from torch_ref._audit_loop import (
    RankParameters,
    _on_ranks,
    _rank0_parameters,
    _same_on_every_rank,
)

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
"""The environment of every run: the Hub offline, no telemetry (read when ``huggingface_hub``
is first imported)."""

# factory(model, args, data, start) -> (the trainer, a list the trainer fills while it trains)
TrainerFactory = Callable[[nn.Module, Any, Any, nn.Module], tuple[Any, list]]


@dataclasses.dataclass(frozen=True)
class TrainerRun:
    """One trainer run of one update: picklable (the ranks unpickle it).

    Attributes:
      factory: a module-level function (or a ``functools.partial`` of one),
        ``factory(model, args, data, start) -> (trainer, records)``: the trainer
        built on ``model`` with ``args``, and the list it fills while it trains;
        ``start`` is the model ``model`` was copied from, untouched (where a run
        puts its parameters back, without a copy of its own).
      args_class: the arguments' class as ``"module.Name"`` (e.g.
        ``"transformers.TrainingArguments"``, ``"trl.GRPOConfig"``), imported in
        the rank after `OFFLINE` is set.
      settings: the arguments but ``output_dir`` (a temporary folder, whatever they say).
      data: what the factory builds the dataset from.
      expected_warnings: the beginnings of the messages of warnings the run expects (the
        trainer's own notices); they are left out while it is built and trained.
    """

    factory: TrainerFactory
    args_class: str
    settings: dict[str, Any]
    data: Any
    expected_warnings: tuple[str, ...] = ()


class TrainerResult(NamedTuple):
    """A run's outcome: rank 0's parameters after the update (those with ``requires_grad``,
    in ``model.parameters()`` order, checked equal on every rank), and each rank's records."""

    params: list[np.ndarray]
    records: list[list]


def run_trainers(
    runs: Sequence[TrainerRun],
    model: nn.Module,
    *,
    world_size: int = 1,
    timeout_s: float = 300.0,
    what: str = "Trainer",
) -> list[TrainerResult]:
    """Trains a fresh copy of ``model`` for each run: here, or on ``world_size`` gloo ranks.

    Args:
      runs: the runs, in order; on ranks all of them in one launch.
      model: the model each run starts from (left as it was).
      world_size: 1 (this process; Python's, numpy's and torch's global random
        states are restored after) or the gloo ranks (CPU, 127.0.0.1,
        `torch_ref.ddp.run`; the trainer wraps the model in
        ``DistributedDataParallel`` through Accelerate).
      timeout_s: the bound of the launch of the ranks, start-up included.
      what: the trainer's name in an error (ranks that end apart).

    Returns:
      A `TrainerResult` per run.
    """
    offline()
    if world_size == 1:
        with _global_rngs_kept():  # the Trainer seeds them (TrainingArguments.seed)
            per_rank = [_rank_runs(0, 1, model, list(runs))]
    else:
        per_rank = _on_ranks(
            world_size, _rank_runs, model, list(runs), timeout_s=timeout_s, environ=OFFLINE
        )
    old = _parameters(model)
    return [
        TrainerResult(
            _same_on_every_rank([rank[i][0] for rank in per_rank], old, what),
            [rank[i][1] for rank in per_rank],
        )
        for i in range(len(runs))
    ]


def offline() -> None:
    """Sets `OFFLINE` in this process's environment, where not set (before ``transformers``)."""
    for name, value in OFFLINE.items():
        os.environ.setdefault(name, value)


@contextlib.contextmanager
def _global_rngs_kept() -> Iterator[None]:
    """Restores Python's, numpy's and torch's (CPU) global random states after the body."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _rank_runs(
    rank: int, world_size: int, model: nn.Module, runs: list[TrainerRun]
) -> list[tuple[RankParameters, list]]:
    """One rank: each run on its own copy of ``model``; (rank 0's parameters, the records)."""
    if world_size > 1:  # ddp.run set torchrun's RANK, WORLD_SIZE, ...: accelerate reads them
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # else accelerate warns and sets it
    results = []
    for run in runs:
        module_name, class_name = run.args_class.rsplit(".", 1)
        args_class = getattr(importlib.import_module(module_name), class_name)
        copied = copy.deepcopy(model)
        with tempfile.TemporaryDirectory(prefix="torch_ref_audit_") as output_dir:
            with warnings.catch_warnings():
                for message in run.expected_warnings:
                    warnings.filterwarnings("ignore", message=re.escape(message))
                args = args_class(**{**run.settings, "output_dir": output_dir})  # never yours
                trainer, records = run.factory(copied, args, run.data, model)
                trainer.train()
        results.append((_rank0_parameters(rank, copied), records))
        # the trainer and its copy of the model (and its gradients) freed before the audit
        # computes its own: the trainer's callbacks hold them in a cycle the collector breaks
        del trainer, copied
        gc.collect()
    return results
