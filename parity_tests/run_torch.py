"""Runs the parity suite's cases through ``torch_ref``: a one-way adapter.

Two scenario descriptions exist on purpose, at two levels. A
:class:`parity_tests.scenarios.Scenario` says how a run is *generated* (world
size, k, data seed, the layout rules, the optimizer's settings), and its
:class:`parity_tests.cases.Case` holds the arrays, prepared once for both
frameworks. A :class:`parity_tests.torch_scenario.Scenario` is the torch run as
``parity_tests.torch_ranks`` takes it (the arrays of every micro-batch of every
rank, the weights, the settings in torch's terms) around ``torch_ref.train_update``,
which knows nothing of the suite. :func:`torch_scenario` goes one way, from the
case to the torch run, with the micro-batches the JAX side gets (padding rows
included).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from parity_tests import torch_ranks
from parity_tests import torch_scenario as ts
from parity_tests.cases import Case
from parity_tests.compare import Run
from tinygpt import TinyGPTConfig


def torch_scenario(case: Case, *, bug: str | None = None, count_comm: bool = False):
    """The torch run of ``case``, optionally with a ``torch_ref.buggy`` bug."""
    scn = case.scn
    o, ls = scn.opt, scn.loss_scaling  # no loss scaling in a big batch (Scenario.big_batch)
    windows = [  # [R, k_u, mb, T] arrays -> windows[u][r][m] dicts
        [
            [{"input_ids": t, "labels": a} for t, a in zip(*rank, strict=True)]
            for rank in zip(tok, lab, strict=True)
        ]
        for tok, lab in case.windows
    ]
    scaling = {}
    if ls is not None:
        scaling = dict(grad_scaler=True, init_scale=ls.init_scale,
                       growth_interval=ls.growth_interval,
                       inf_microbatches=frozenset(ls.inf_microbatches))  # fmt: skip
    schedule = ts.WarmupCosine(o.warmup, o.decay_steps, o.init_lr, o.end_lr)
    return ts.Scenario(
        config=TinyGPTConfig(),
        weights=case.weights,
        windows=windows,
        optimizer=ts.AdamW(o.lr, (o.b1, o.b2), o.eps, o.weight_decay),
        schedule=schedule if o.schedule == "warmup_cosine" else None,
        max_grad_norm=o.max_grad_norm,
        unit=scn.unit,
        precision=case.precision,
        bug=bug,
        nominal_k=scn.k,
        count_comm=count_comm and scn.world > 1,
        **scaling,
    )


@dataclasses.dataclass(frozen=True)
class TorchJob:
    """One torch_ref run to do: the case, a bug (or None), whether it is a big batch."""

    case: Case
    bug: str | None = None
    big_batch: bool = False  # the case is a big batch's: labelled "torch big batch"
    count_comm: bool = False  # count DDP gradient all-reduces (world size > 1)

    @property
    def label(self) -> str:
        if self.big_batch:
            return "torch big batch"
        return "torch_ref" if self.bug is None else f"torch_ref:{self.bug}"


def run_torch_jobs(jobs: list[TorchJob], *, device: str = "cpu", timeout_s: float = 600.0):
    """Runs every job through ``torch_ranks.run_scenarios`` (one launch per world size).

    Returns one :class:`Run` per job, params as float64 torch-layout dicts with
    the initial weights first. ``seconds`` is the batch's wall time split evenly.
    """
    t0 = time.perf_counter()
    scenarios = [torch_scenario(j.case, bug=j.bug, count_comm=j.count_comm) for j in jobs]
    backend = None
    if device == "cuda":
        import torch

        # NCCL refuses two ranks on one GPU; gloo accepts CUDA tensors.
        if max(s.world_size for s in scenarios) > torch.cuda.device_count():
            backend = "gloo"
    results = torch_ranks.run_scenarios(
        scenarios, device=device, backend=backend, timeout_s=timeout_s
    )
    per_job = (time.perf_counter() - t0) / max(1, len(jobs))
    runs = []
    for job, res in zip(jobs, results, strict=True):
        init = {n: np.asarray(v, np.float64) for n, v in job.case.weights.items()}
        params = [init] + [{n: np.asarray(v, np.float64) for n, v in p.items()} for p in res.params]
        runs.append(
            Run(job.label, [dict(r) for r in res.records], params, per_job, {"comm": res.comm})
        )
    return runs
