"""Scenarios: plain-numpy training runs, the interface of the parity tests.

A `Scenario` is everything needed to reproduce a run, as numpy + dataclasses:
the model config, the initial weights (``export_state_dict`` layout), the data
laid out as ``windows[u][r][m]`` (update u, rank r, micro-batch m; each a dict
``{"input_ids": int64 [B, T], "labels": int64 [B, T]}``), the optimizer and
schedule settings, the precision and optional faults. `run_scenarios` runs a
list of them (world size 1 in this process without DDP; world size R > 1 in R
real DDP processes, one spawn per world size for the whole list) and returns,
per scenario, the window records and the parameters after each window.

Optimizer semantics (the same numbers optax uses):

    AdamW:  torch.optim.AdamW(lr, betas, eps, weight_decay), decoupled decay
            p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)
            == optax.adamw(lr, b1, b2, eps, weight_decay=weight_decay)
    SGD:    p <- p - lr * g   (no momentum) == optax.sgd(lr)
    WarmupCosine: the learning rate of update t (t = number of updates already
            applied, 0 for the first) is optax.warmup_cosine_decay_schedule(
            init_value, peak_value=optimizer lr, warmup_steps, decay_steps, end_value)(t).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from torch_ref import ddp
from torch_ref._model import TinyGPT, TinyGPTConfig, load_state_dict_numpy
from torch_ref._train import EMA, Progress, train_update

NumpyBatch = dict[str, np.ndarray]
Window = list[list[NumpyBatch]]  # [rank][micro]


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW settings (torch.optim.AdamW == optax.adamw with the same numbers)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclasses.dataclass(frozen=True)
class SGD:
    """Plain SGD, ``p <- p - lr * g`` (makes gradient scale visible in updates)."""

    lr: float = 1e-2


@dataclasses.dataclass(frozen=True)
class WarmupCosine:
    """optax.warmup_cosine_decay_schedule, peak = the optimizer's lr.

    Math, for update count t:
      t < warmup_steps:  init_value + (peak - init_value) * t / warmup_steps
      otherwise:         s = min(t - warmup_steps, D) / D, D = decay_steps - warmup_steps
                         end_value + (peak - end_value) * 0.5 * (1 + cos(pi * s))
    """

    warmup_steps: int
    decay_steps: int
    init_value: float = 0.0
    end_value: float = 0.0

    def __call__(self, t: int, peak: float) -> float:
        """Learning rate of update t (0-based count of applied updates)."""
        if t < self.warmup_steps:
            return self.init_value + (peak - self.init_value) * t / self.warmup_steps
        span = max(self.decay_steps - self.warmup_steps, 1)
        s = min(t - self.warmup_steps, span) / span
        alpha = self.end_value / peak if peak else 0.0
        return peak * ((1.0 - alpha) * 0.5 * (1.0 + math.cos(math.pi * s)) + alpha)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A training run as plain data (see the module docstring).

    Attributes:
      config: the TinyGPT shapes.
      weights: initial parameters, {name: float32 array}, `export_state_dict` layout.
      windows: ``windows[u][r][m]`` = {"input_ids", "labels"} int64 [B, T] arrays;
        the world size is ``len(windows[u])`` (the same for every u); k may vary
        per window (a tail window), but not between the ranks of one window.
      optimizer: `AdamW` or `SGD` settings.
      schedule: optional `WarmupCosine` (peak = optimizer lr), stepped per applied update.
      max_grad_norm: global-norm clipping of the window gradient (None: off).
      unit: "token" or "sample".
      precision: "fp32"; "fp64" (float64 parameters and compute; results in
        float64); "bf16" (autocast bfloat16, no scaler); "fp16" (autocast
        float16 + GradScaler). Parameters stay float32 except for "fp64".
      grad_scaler: force a GradScaler on (True) or off (False); default: on for fp16.
        ``precision="fp32", grad_scaler=True`` exercises scale/unscale/skip in fp32.
      init_scale: the GradScaler's initial scale.
      growth_interval: the GradScaler's growth interval (consecutive unskipped
        windows before the scale doubles; torch's default 2000).
      ema_decay: track an `EMA` of the parameters with this decay (None: off).
      empty_window: "raise" or "skip" (see `train_update`).
      bug: None, or a name of `torch_ref.buggy.BUG_NAMES`.
      nominal_k: the configured k (only for bug="fixed_divisor_tail"; default:
        the number of micro-batches of the first window).
      inf_microbatches: fault injection, a set of (u, r, m): the logits of that
        micro-batch are multiplied by +inf (its loss and gradient become NaN).
      record_grads: also return the window gradient handed to the optimizer
        (after unscale and clip) for every window.
      count_comm: register a counting DDP communication hook (world size > 1).
    """

    config: TinyGPTConfig
    weights: dict[str, np.ndarray]
    windows: list[Window]
    optimizer: AdamW | SGD = AdamW()
    schedule: WarmupCosine | None = None
    max_grad_norm: float | None = None
    unit: str = "token"
    precision: str = "fp32"
    grad_scaler: bool | None = None
    init_scale: float = 2.0**16
    growth_interval: int = 2000
    ema_decay: float | None = None
    empty_window: str = "raise"
    bug: str | None = None
    nominal_k: int | None = None
    inf_microbatches: frozenset[tuple[int, int, int]] = frozenset()
    record_grads: bool = False
    count_comm: bool = False

    @property
    def world_size(self) -> int:
        """Number of ranks, ``len(windows[0])``."""
        return len(self.windows[0])


@dataclasses.dataclass
class ScenarioResult:
    """What one scenario produced (rank 0's view; DDP keeps ranks identical).

    Attributes:
      records: one `train_update` record per window, skipped windows included.
      params: parameters after each window, {name: array} (torch layout;
        float32, float64 for precision "fp64").
      grads: if ``record_grads``: the gradient handed to the optimizer per window
        (after unscale and clipping; inf/NaN on a non-finite window).
      ema: if ``ema_decay``: the EMA shadow parameters after each window.
      comm: if ``count_comm`` and world size > 1, per window:
        ``synced_backwards`` (backward passes that launched a gradient
        all-reduce) and ``allreduce_buckets`` (bucket all-reduces launched).
      rank_records: the records of every rank, ``rank_records[r][u]``.
    """

    records: list[dict[str, Any]]
    params: list[dict[str, np.ndarray]]
    grads: list[dict[str, np.ndarray]] | None = None
    ema: list[dict[str, np.ndarray]] | None = None
    comm: list[dict[str, int]] | None = None
    rank_records: list[list[dict[str, Any]]] = dataclasses.field(default_factory=list)


def split_window(input_ids: np.ndarray, labels: np.ndarray, world_size: int, k: int) -> Window:
    """Deals one global batch into ``world_size`` ranks x ``k`` micro-batches.

    Samples are cut into ``world_size * k`` equal consecutive chunks; rank r
    gets chunks ``r*k .. r*k + k - 1`` as its micro-batches, in order.

    Args:
      input_ids, labels: [S, T] int arrays; S divisible by world_size * k.
      world_size, k: the layout.

    Returns:
      ``window[r][m]`` = {"input_ids": [S / (R k), T], "labels": same}.
    """
    n = input_ids.shape[0]
    parts = world_size * k
    if n % parts:
        raise ValueError(
            f"input_ids: batch of {n} samples is not divisible by world_size * k = {parts}"
        )
    size = n // parts
    chunk = lambda a, i: np.ascontiguousarray(a[i * size : (i + 1) * size], dtype=np.int64)  # noqa: E731
    return [
        [
            {"input_ids": chunk(input_ids, r * k + m), "labels": chunk(labels, r * k + m)}
            for m in range(k)
        ]
        for r in range(world_size)
    ]


@contextlib.contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Runs the body with ``torch.set_num_threads(1)``, restoring the count after.

    The tiny model is far too small for intra-op parallelism; on some hosts
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


def _np(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """float32 (float64 stays float64) numpy copies."""
    return {
        n: t.detach().to("cpu", torch.promote_types(t.dtype, torch.float32)).numpy().copy()
        for n, t in tensors.items()
    }


def _make_optimizer(settings: AdamW | SGD, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
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


class _Counters:
    """Forward index within the current window, and gradient all-reduces seen."""

    def __init__(self) -> None:
        self.update = 0
        self.forward_index = -1
        self.buckets = 0
        self.synced: set[int] = set()

    def new_window(self, update: int) -> None:
        self.update, self.forward_index, self.buckets, self.synced = update, -1, 0, set()


def _counting_hook(state, bucket):  # annotations set below (DDP checks the real objects)
    """DDP comm hook: count, then the default all-reduce (average over ranks)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state.buckets += 1
    state.synced.add(state.forward_index)
    return default_hooks.allreduce_hook(None, bucket)


# DistributedDataParallel.register_comm_hook compares these annotations to the
# real classes, which `from __future__ import annotations` would turn into strings.
_counting_hook.__annotations__ = {
    "state": _Counters,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _run_one(
    scenario: Scenario, rank: int, world_size: int, device: torch.device
) -> ScenarioResult:
    """Runs one scenario on this rank (inside a process group when world_size > 1)."""
    if scenario.world_size != world_size:
        raise ValueError(
            f"windows: expected {world_size} ranks per window, got {scenario.world_size}"
        )
    if scenario.precision not in ("fp32", "fp64", "bf16", "fp16"):
        raise ValueError(
            f"precision: expected 'fp32', 'fp64', 'bf16' or 'fp16', got {scenario.precision!r}"
        )
    model = TinyGPT(scenario.config)
    if scenario.precision == "fp64":
        model.double()
    load_state_dict_numpy(model, scenario.weights)
    model.to(device)
    counters = _Counters()
    inf_set = set(scenario.inf_microbatches)

    def forward_hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        counters.forward_index += 1
        if (counters.update, rank, counters.forward_index) in inf_set:
            return output * float("inf")
        return output

    model.register_forward_hook(forward_hook)
    wrapped: nn.Module = model
    if world_size > 1:
        wrapped = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        if scenario.count_comm:
            wrapped.register_comm_hook(counters, _counting_hook)

    optimizer = _make_optimizer(scenario.optimizer, list(model.parameters()))
    scheduler = None
    if scenario.schedule is not None:
        peak = scenario.optimizer.lr
        schedule = scenario.schedule
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: schedule(t, peak) / peak)
    autocast_dtype = {"fp32": None, "fp64": None, "bf16": torch.bfloat16, "fp16": torch.float16}[
        scenario.precision
    ]
    use_scaler = (
        scenario.grad_scaler if scenario.grad_scaler is not None else scenario.precision == "fp16"
    )
    scaler = (
        torch.amp.GradScaler(
            device.type, init_scale=scenario.init_scale, growth_interval=scenario.growth_interval
        )
        if use_scaler
        else None
    )
    ema = EMA(model, scenario.ema_decay) if scenario.ema_decay is not None else None
    nominal_k = scenario.nominal_k or len(scenario.windows[0][0])

    progress = Progress()
    result = ScenarioResult(
        records=[],
        params=[],
        grads=[] if scenario.record_grads else None,
        ema=[] if ema is not None else None,
        comm=[] if scenario.count_comm and world_size > 1 else None,
    )
    for u, window in enumerate(scenario.windows):
        counters.new_window(u)
        microbatches = [
            {
                key: torch.from_numpy(np.asarray(mb[key], dtype=np.int64))
                for key in ("input_ids", "labels")
            }
            for mb in window[rank]
        ]
        record = train_update(
            wrapped,
            microbatches,
            optimizer,
            scheduler=scheduler,
            max_grad_norm=scenario.max_grad_norm,
            scaler=scaler,
            unit=scenario.unit,
            empty_window=scenario.empty_window,
            ema=ema,
            progress=progress,
            autocast_dtype=autocast_dtype,
            bug=scenario.bug,
            nominal_k=nominal_k,
        )
        result.records.append(record)
        result.params.append(_np(dict(model.named_parameters())))
        if result.grads is not None:
            result.grads.append(
                _np(
                    {
                        n: p.grad if p.grad is not None else torch.zeros_like(p)
                        for n, p in model.named_parameters()
                    }
                )
            )
        if result.ema is not None and ema is not None:
            result.ema.append(_np(ema.shadow))
        if result.comm is not None:
            result.comm.append(
                {"synced_backwards": len(counters.synced), "allreduce_buckets": counters.buckets}
            )
    result.rank_records = [result.records]
    return result


def _worker(rank: int, world_size: int, scenarios: list[Scenario]) -> list[ScenarioResult]:
    device = ddp.current_device()
    results = [_run_one(s, rank, world_size, device) for s in scenarios]
    if rank != 0:  # only rank 0 ships parameters back; others ship their records
        results = [ScenarioResult(records=r.records, params=[]) for r in results]
    return results


def run_scenarios(
    scenarios: Sequence[Scenario],
    *,
    device: str = "cpu",
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> list[ScenarioResult]:
    """Runs scenarios; one DDP spawn per distinct world size > 1.

    World size 1 runs in this process on a plain module (no process group);
    world size R > 1 runs in R real processes (`torch_ref.ddp.run`), which run
    all scenarios of that world size one after the other.

    Args:
      scenarios: the runs.
      device: "cpu" or "cuda".
      backend: process-group backend; default "gloo" on CPU, "nccl" on CUDA.
      timeout_s: bound of each spawn (start-up included).

    Returns:
      one `ScenarioResult` per scenario, in order (rank 0's records and
      parameters; ``rank_records`` holds every rank's records).
    """
    results: list[ScenarioResult | None] = [None] * len(scenarios)
    by_world: dict[int, list[int]] = {}
    for i, s in enumerate(scenarios):
        by_world.setdefault(s.world_size, []).append(i)
    for world_size, indices in sorted(by_world.items()):
        if world_size == 1:
            dev = torch.device(device)
            with one_cpu_thread():
                for i in indices:
                    results[i] = _run_one(scenarios[i], 0, 1, dev)
            continue
        per_rank = ddp.run(
            world_size,
            _worker,
            [scenarios[i] for i in indices],
            backend=backend or ("nccl" if device == "cuda" else "gloo"),
            device=device,
            timeout_s=timeout_s,
        )
        for j, i in enumerate(indices):
            res = per_rank[0][j]
            res.rank_records = [per_rank[r][j].records for r in range(world_size)]
            results[i] = res
    return [r for r in results if r is not None]


def run_scenario(scenario: Scenario, **kwargs: Any) -> ScenarioResult:
    """`run_scenarios` for a single scenario (same keyword arguments)."""
    return run_scenarios([scenario], **kwargs)[0]
