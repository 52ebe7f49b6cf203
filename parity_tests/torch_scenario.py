"""A torch run as plain data: a `Scenario` (numpy and frozen dataclasses), and what it produced.

A `Scenario` is everything needed to reproduce a torch run: the model config,
the initial weights (torch layout), the data laid out as ``windows[u][r][m]``
(update u, rank r, micro-batch m; each ``{"input_ids", "labels"}`` int64
[B, T]), the optimizer and schedule settings, the precision and optional
faults. ``parity_tests.torch_ranks.run_scenarios`` (in this process and
``torch.multiprocessing`` ranks) and ``python -m parity_tests.torch_launch``
under torchrun run it with `torch_ref.train_update`; each gives a `ScenarioResult`::

    window = split_window(input_ids, labels, world_size, k)   # [rank][micro] dicts
    scenario = Scenario(
        config=TinyGPTConfig(block_size=32),
        weights=export_state_dict(TinyGPT(config, seed=0)),   # or the JAX side's
        windows=[window_0, window_1, ...],                    # windows[u][r][m]
        optimizer=AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
        schedule=WarmupCosine(warmup_steps=2, decay_steps=10),  # optional
        max_grad_norm=None, unit="token", precision="fp32"|"fp64"|"bf16"|"fp16",
        empty_window="raise", bug=None,                       # or a name of buggy.VARIANTS
        inf_microbatches=frozenset({(u, r, m)}), record_grads=False, count_comm=False)
    results = run_scenarios([scenario, ...], device="cpu", timeout_s=300)
    results[i].records       # one record per window
    results[i].params        # params after each window, {name: array} (float32;
                             # float64 for "fp64")
    results[i].grads / .comm / .rank_records   # optional extras

Tolerances (measured, ``tinygpt.torch_testing.skewed_batch`` data, 3 AdamW
updates at lr 1e-3, float32): the window gradient of any layout matches the big
batch to ~3e-7 relative; parameters to ~2e-6 absolute. The parameter gap is set
by the attention key bias, whose gradient is exactly 0 in exact arithmetic
(softmax ignores a per-query constant) but ~1e-10 from rounding: Adam divides
it by sqrt(v) + eps and turns it into a layout-dependent step. In float64
("fp64") the same comparison gives ~2e-14.

Optimizer semantics (the numbers optax uses):

    AdamW:  torch.optim.AdamW(lr, betas, eps, weight_decay), decoupled decay
            p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)
            == optax.adamw(lr, b1, b2, eps, weight_decay=weight_decay)
    SGD:    p <- p - lr * g   (no momentum) == optax.sgd(lr)
    WarmupCosine: the learning rate of update t (t = updates already applied)
            is optax.warmup_cosine_decay_schedule(init_value, peak_value=the
            optimizer's lr, warmup_steps, decay_steps, end_value)(t).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from tinygpt import TinyGPTConfig

NumpyBatch = dict[str, np.ndarray]
Window = list[list[NumpyBatch]]  # [rank][micro]
PRECISIONS = ("fp32", "fp64", "bf16", "fp16")


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW settings (torch.optim.AdamW == optax.adamw with the same numbers)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclasses.dataclass(frozen=True)
class SGD:
    """Plain SGD, ``p <- p - lr * g`` (makes the gradient's scale visible in the update)."""

    lr: float = 1e-2


@dataclasses.dataclass(frozen=True)
class WarmupCosine:
    """optax.warmup_cosine_decay_schedule with peak = the optimizer's lr.

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
      weights: initial parameters, {name: array}, torch layout (`tinygpt.weights`).
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
      empty_window: "raise" or "skip" (see `train_update`).
      bug: None, or a name of `torch_ref.buggy.VARIANTS`.
      nominal_k: the configured k (only for bug="fixed_divisor_tail"; default:
        the number of micro-batches of the first window).
      inf_microbatches: fault injection, a set of (u, r, m): the logits of that
        micro-batch are multiplied by +inf (its loss and gradient become NaN).
      record_grads: also return the window gradient handed to the optimizer
        (after unscale and clip) for every window.
      count_comm: count DDP's gradient all-reduces (world size > 1).

    Raises:
      ValueError: an unknown precision, or windows with different world sizes.
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
    empty_window: str = "raise"
    bug: str | None = None
    nominal_k: int | None = None
    inf_microbatches: frozenset[tuple[int, int, int]] = frozenset()
    record_grads: bool = False
    count_comm: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, got {self.precision!r}")
        if len({len(window) for window in self.windows}) > 1:
            raise ValueError("windows: every window must have the same number of ranks")

    @property
    def world_size(self) -> int:
        """Number of ranks, ``len(windows[0])``."""
        return len(self.windows[0])


@dataclasses.dataclass
class ScenarioResult:
    """What one scenario produced (rank 0's view; DDP keeps the ranks identical).

    Attributes:
      records: one `train_update` record per window, skipped windows included.
      params: parameters after each window, {name: array} (torch layout;
        float32, float64 for precision "fp64").
      grads: if ``record_grads``: the gradient handed to the optimizer per window
        (after unscale and clipping; inf/NaN on a non-finite window).
      comm: if ``count_comm`` and world size > 1, per window:
        ``synced_backwards`` (backward passes that launched a gradient
        all-reduce) and ``allreduce_buckets`` (bucket all-reduces launched).
      rank_records: the records of every rank, ``rank_records[r][u]``.
    """

    records: list[dict[str, Any]]
    params: list[dict[str, np.ndarray]]
    grads: list[dict[str, np.ndarray]] | None = None
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
    chunk = lambda a, i: np.ascontiguousarray(a[i * size : (i + 1) * size], dtype=np.int64)
    return [
        [
            {"input_ids": chunk(input_ids, r * k + m), "labels": chunk(labels, r * k + m)}
            for m in range(k)
        ]
        for r in range(world_size)
    ]
