"""Runs the parity suite's scenarios through ``torch_ref``: a one-way adapter.

Two scenario descriptions exist on purpose, at two levels. A
:class:`parity_tests.scenarios.Scenario` says how a run is *generated* (world
size, k, data seed, the layout rules, the optimizer's settings); it is the
suite's, and both frameworks' runners read it. A ``torch_ref.Scenario`` is the
*materialized* run (the arrays of every micro-batch of every rank, the
weights, the settings in torch's terms) that ``torch_ref`` runs without
knowing the suite exists. :func:`torch_scenario` goes one way, from the first
to the second, with the micro-batches laid out exactly as the JAX side lays
them out (:func:`parity_tests.scenarios.layouts`, padding rows included).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from parity_tests.compare import Run
from parity_tests.scenarios import Scenario, layouts

PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float64": "fp64"}


def torch_scenario(
    scn: Scenario,
    weights: dict[str, np.ndarray],
    *,
    bug: str | None = None,
    big_batch: bool = False,
    count_comm: bool = False,
):
    """The ``torch_ref.Scenario`` of ``scn`` (or of its big batch), optionally with a bug."""
    import torch_ref

    scn = scn.big_batch() if big_batch else scn
    o, ls = scn.opt, scn.loss_scaling  # no loss scaling in a big batch (Scenario.big_batch)
    windows = [  # [R, k_u, mb, T] arrays -> windows[u][r][m] dicts
        [
            [{"input_ids": t, "labels": a} for t, a in zip(*rank, strict=True)]
            for rank in zip(tok, lab, strict=True)
        ]
        for tok, lab in layouts(scn)
    ]
    schedule = torch_ref.WarmupCosine(o.warmup, o.decay_steps, o.init_lr, o.end_lr)
    scaling = (
        {}
        if ls is None
        else dict(
            grad_scaler=True,
            init_scale=ls.init_scale,
            growth_interval=ls.growth_interval,
            inf_microbatches=frozenset(ls.inf_microbatches),
        )
    )
    return torch_ref.Scenario(
        config=torch_ref.TinyGPTConfig(),
        weights=weights,
        windows=windows,
        optimizer=torch_ref.AdamW(o.lr, (o.b1, o.b2), o.eps, o.weight_decay),
        schedule=schedule if o.schedule == "warmup_cosine" else None,
        max_grad_norm=o.max_grad_norm,
        unit=scn.unit,
        precision=PRECISION[scn.dtype],
        bug=bug,
        nominal_k=scn.k,
        count_comm=count_comm and scn.world > 1,
        **scaling,
    )


@dataclasses.dataclass(frozen=True)
class TorchJob:
    """One torch_ref run to do: the scenario, a bug (or None) and big batch or not."""

    scn: Scenario
    bug: str | None = None
    big_batch: bool = False
    count_comm: bool = False  # count DDP gradient all-reduces (world size > 1)

    @property
    def label(self) -> str:
        if self.big_batch:
            return "torch big batch"
        return "torch_ref" if self.bug is None else f"torch_ref:{self.bug}"


def run_torch_jobs(
    jobs: list[TorchJob],
    weights: dict[str, np.ndarray],
    *,
    device: str = "cpu",
    timeout_s: float = 600.0,
) -> list[Run]:
    """Runs every job through ``torch_ref.run_scenarios`` (one launch per world size).

    Returns one :class:`Run` per job, params as float64 torch-layout dicts with
    the initial weights first. ``seconds`` is the batch's wall time split evenly.
    """
    import torch_ref

    t0 = time.perf_counter()
    scenarios = [
        torch_scenario(j.scn, weights, bug=j.bug, big_batch=j.big_batch, count_comm=j.count_comm)
        for j in jobs
    ]
    backend = None
    if device == "cuda":
        import torch

        # NCCL refuses two ranks on one GPU; gloo accepts CUDA tensors.
        if max(s.world_size for s in scenarios) > torch.cuda.device_count():
            backend = "gloo"
    results = torch_ref.run_scenarios(
        scenarios, device=device, backend=backend, timeout_s=timeout_s
    )
    per_job = (time.perf_counter() - t0) / max(1, len(jobs))
    init = {n: np.asarray(v, np.float64) for n, v in weights.items()}
    runs = []
    for job, res in zip(jobs, results, strict=True):
        params = [init] + [{n: np.asarray(v, np.float64) for n, v in p.items()} for p in res.params]
        runs.append(
            Run(job.label, [dict(r) for r in res.records], params, per_job, {"comm": res.comm})
        )
    return runs
