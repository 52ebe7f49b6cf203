"""Torch runs: one rank's run (`run_on_rank`) and the in-process launcher (`run_scenarios`).

`run_on_rank` is the whole run of one `parity_tests.torch_scenario.Scenario` on
one rank: it builds the model (``tinygpt.torch_gpt``), the optimizer, the
schedule and the GradScaler the scenario describes, attaches the instruments
(``parity_tests.torch_instrument``), and calls `torch_ref.train_update` once per
window. Two launchers call it:

* `run_scenarios`: world size 1 in this process on a plain module (inside
  ``torch_ref.one_cpu_thread()``); each world size R > 1 in R
  ``torch.multiprocessing`` ranks (`torch_ref.ddp.run`: gloo on CPU, nccl on
  CUDA), one launch for all the scenarios of that world size (scripts that
  launch ranks need the usual ``if __name__ == "__main__":`` guard);
* ``torchrun --nproc_per_node=R -m parity_tests.torch_launch`` (the standard
  launcher, from and to files).

Both run the same function on the same ranks, so they give the same records
and parameters (``torch_launch_test.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from parity_tests.torch_instrument import WindowProbe
from parity_tests.torch_scenario import SGD, AdamW, Scenario, ScenarioResult
from tinygpt.torch_gpt import TinyGPT, load_state_dict_numpy
from torch_ref import Progress, buggy, ddp, train_update
from torch_ref._steps import Microbatch
from torch_ref.ddp import one_cpu_thread

AUTOCAST = {"fp32": None, "fp64": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def run_on_rank(
    scenario: Scenario, rank: int, world_size: int, device: torch.device
) -> ScenarioResult:
    """Runs ``scenario`` on this rank (inside a process group when ``world_size > 1``).

    Args:
      scenario: the run.
      rank, world_size: this process's place (``world_size == scenario.world_size``).
      device: where the model lives.

    Returns:
      this rank's `ScenarioResult` (``rank_records`` holds its own records only).

    Raises:
      ValueError: the scenario's world size is not ``world_size``, or a bad setting.
    """
    if scenario.world_size != world_size:
        raise ValueError(
            f"windows: expected {world_size} ranks per window, got {scenario.world_size}"
        )
    model, wrapped = _model_on_rank(scenario, world_size, device)
    probe = WindowProbe(rank, scenario.inf_microbatches)
    counted = wrapped if scenario.count_comm and world_size > 1 else None
    probe.attach(model, counted)
    optimizer = _optimizer(scenario.optimizer, model.parameters())
    settings = _update_settings(scenario, optimizer, device)
    result = ScenarioResult(
        records=[],
        params=[],
        grads=[] if scenario.record_grads else None,
        comm=[] if counted is not None else None,
    )
    for u, window in enumerate(scenario.windows):
        probe.new_window(u)
        microbatches = _torch_microbatches(window[rank])
        result.records.append(train_update(wrapped, microbatches, optimizer, **settings))
        result.params.append(_numpy(dict(model.named_parameters())))
        if result.grads is not None:
            grads = {n: _grad_or_zeros(p) for n, p in model.named_parameters()}
            result.grads.append(_numpy(grads))
        if result.comm is not None:
            result.comm.append(probe.counts())
    result.rank_records = [result.records]
    return result


def run_scenarios(
    scenarios: Sequence[Scenario],
    *,
    device: str = "cpu",
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> list[ScenarioResult]:
    """Runs scenarios: world size 1 in this process, one launch of R ranks per world size R > 1.

    Args:
      scenarios: the runs.
      device: "cpu" or "cuda".
      backend: the process-group backend; default "gloo" on CPU, "nccl" on CUDA.
      timeout_s: bound of each launch (start-up included).

    Returns:
      one `ScenarioResult` per scenario, in order: rank 0's records and
      parameters, every rank's records in ``rank_records``.
    """
    results: dict[int, ScenarioResult] = {}
    by_world: dict[int, list[int]] = {}
    for i, s in enumerate(scenarios):
        by_world.setdefault(s.world_size, []).append(i)
    for world_size, indices in sorted(by_world.items()):
        if world_size == 1:
            with one_cpu_thread():
                for i in indices:
                    results[i] = run_on_rank(scenarios[i], 0, 1, torch.device(device))
            continue
        per_rank = ddp.run(
            world_size,
            _ranks_main,
            [scenarios[i] for i in indices],
            backend=backend or ("nccl" if device == "cuda" else "gloo"),
            device=device,
            timeout_s=timeout_s,
        )
        for j, i in enumerate(indices):
            results[i] = per_rank[0][j]
            results[i].rank_records = [per_rank[r][j].records for r in range(world_size)]
    return [results[i] for i in range(len(scenarios))]


def run_scenario(scenario: Scenario, **kwargs: Any) -> ScenarioResult:
    """`run_scenarios` for a single scenario (the same keyword arguments)."""
    return run_scenarios([scenario], **kwargs)[0]


def _ranks_main(rank: int, world_size: int, scenarios: list[Scenario]) -> list[ScenarioResult]:
    """One rank of `run_scenarios`: every scenario; only rank 0 ships its parameters back."""
    results = [run_on_rank(s, rank, world_size, ddp.current_device()) for s in scenarios]
    if rank != 0:
        results = [ScenarioResult(records=r.records, params=[]) for r in results]
    return results


def _model_on_rank(
    scenario: Scenario, world_size: int, device: torch.device
) -> tuple[TinyGPT, nn.Module]:
    """(the scenario's TinyGPT on ``device``, the module to train: DDP-wrapped for R > 1)."""
    model = TinyGPT(scenario.config)
    if scenario.precision == "fp64":
        model.double()
    load_state_dict_numpy(model, scenario.weights)
    model.to(device)
    if world_size == 1:
        return model, model
    ids = [device.index] if device.type == "cuda" else None
    return model, nn.parallel.DistributedDataParallel(model, device_ids=ids)


def _update_settings(
    scenario: Scenario, optimizer: torch.optim.Optimizer, device: torch.device
) -> dict[str, Any]:
    """The keyword arguments of `train_update` the scenario describes (fresh counters)."""
    return dict(
        scheduler=_scheduler(scenario, optimizer),
        max_grad_norm=scenario.max_grad_norm,
        scaler=_grad_scaler(scenario, device),
        unit=scenario.unit,
        empty_window=scenario.empty_window,
        autocast_dtype=AUTOCAST[scenario.precision],
        variant=buggy.variant(scenario.bug),
        nominal_k=scenario.nominal_k or len(scenario.windows[0][0]),
        progress=Progress(),
    )


def _torch_microbatches(microbatches: Sequence[dict[str, np.ndarray]]) -> list[Microbatch]:
    """One rank's micro-batches of a window as int64 tensors (``input_ids``, ``labels``)."""
    return [
        {key: torch.from_numpy(np.asarray(mb[key], np.int64)) for key in ("input_ids", "labels")}
        for mb in microbatches
    ]


def _optimizer(settings: AdamW | SGD, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The torch optimizer of the scenario's settings."""
    if isinstance(settings, AdamW):
        return torch.optim.AdamW(
            params,
            lr=settings.lr,
            betas=settings.betas,
            eps=settings.eps,
            weight_decay=settings.weight_decay,
        )
    if isinstance(settings, SGD):
        return torch.optim.SGD(params, lr=settings.lr)
    raise ValueError(f"optimizer: expected AdamW or SGD settings, got {settings!r}")


def _scheduler(scenario: Scenario, optimizer: torch.optim.Optimizer) -> Any | None:
    """``LambdaLR`` of the scenario's `WarmupCosine` (None without a schedule)."""
    if scenario.schedule is None:
        return None
    peak, schedule = scenario.optimizer.lr, scenario.schedule
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: schedule(t, peak) / peak)


def _grad_scaler(scenario: Scenario, device: torch.device) -> torch.amp.GradScaler | None:
    """The scenario's GradScaler: on for fp16 unless ``grad_scaler`` says otherwise."""
    on = scenario.grad_scaler if scenario.grad_scaler is not None else scenario.precision == "fp16"
    if not on:
        return None
    return torch.amp.GradScaler(
        device.type, init_scale=scenario.init_scale, growth_interval=scenario.growth_interval
    )


def _grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    """The parameter's gradient (zeros where it took none)."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Numpy copies, float32 (float64 stays float64)."""
    return {
        n: t.detach().to("cpu", torch.promote_types(t.dtype, torch.float32)).numpy().copy()
        for n, t in tensors.items()
    }
