"""Scenarios: one numpy description of a training run, and its arrays, fed to both frameworks.

A :class:`Scenario` fixes everything that decides the numbers besides the
initial weights (numpy, from ``tinygpt.weights.init_state_dict``): the data,
the window layout (world size ``R``, micro-batches per window ``k``), the loss
unit (``token`` or ``sample``), the dtype and the optimizer (AdamW, optionally
with optax's warmup-cosine schedule and global-norm clipping).

Data (``tinygpt.data``, the project's one generator and one layout). Update
``u`` consumes one *global batch* of ``samples_per_update`` rows ``[S, T]``
(:func:`global_batches`): corpus samples with masked prompts and skewed
response lengths (the default batch of 16 holds 2 samples with no valid token,
6 with 2-5, 2 with 20-40 and 6 with ~100), which is what makes the
mean-of-means and local-denominator bugs visible. The same global batch is
cut, for every ``(R, k)``, into ``R * k`` micro-batches (:func:`layouts`,
``tinygpt.data.split_rows``): the ranks get different numbers of loss units (rank
shares grow as 1 : 2 : ... : R of the non-empty samples), and whenever
``R * k > 1`` one micro-batch has no valid token (the last of the last rank;
with ``k = 1`` that is the whole last rank). Big batch: ``R = k = 1``.

The suite's matrix of scenarios and their cases (dtypes and arrays, prepared once):
``parity_tests.cases``.

Example::

    >>> scn = Scenario(world=2, k=2)
    >>> batches = global_batches(scn)          # n_updates x (tokens, labels) [S, T]
    >>> tok, lab = layouts(scn)[0]             # [R, k, mb, T]
    >>> tok.shape[:2], data.units(lab, "token").sum(-1).tolist()
    ((2, 2), [[127, 5], [544, 0]])
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tinygpt import data
from tinygpt.data import UNITS

DTYPES = ("float32", "float64", "bfloat16")
DTYPE_IDS = {"float32": "f32", "float64": "f64", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW`` and ``optax.adamw``).

    ``schedule="constant"``: ``lr(u) = lr``. ``schedule="warmup_cosine"``: optax's
    ``warmup_cosine_decay_schedule(init_lr, lr, warmup, decay_steps, end_lr)`` of
    ``u`` = updates applied so far (never micro-steps); the torch side's
    ``torch_ref.WarmupCosine`` is checked against optax in ``warmup_cosine_test.py``.
    """

    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    schedule: str = "constant"  # or "warmup_cosine"
    warmup: int = 2
    decay_steps: int = 8
    init_lr: float = (
        1e-4  # > 0: the first update must move the parameters (deviation is relative to it)
    )
    end_lr: float = 1e-5
    max_grad_norm: float | None = None


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """fp16-style dynamic loss scaling with a forced overflow, the same on both sides.

    jaxaccum: ``multi_steps(..., loss_scaling=DynamicLossScale(init_scale, 2.0, 0.5,
    growth_interval))``, the summed loss multiplied by ``loss_scale(state)`` before
    differentiation. torch_ref: a ``GradScaler(init_scale, growth_interval=...)``.
    The compute stays float32 (fp16 autocast is impractical on CPU): the scaler's
    schedule (scale, unscale, skip, backoff, growth) is what is exercised; the
    scales are powers of two, so scaling is exact and the parameters are those of fp32.

    Attributes:
      init_scale: the initial loss scale.
      growth_interval: applied windows between two doublings of the scale.
      inf_microbatches: ``(u, r, m)`` micro-batches whose logits are multiplied by
        +inf (loss and gradient become NaN: the window overflows and is skipped),
        ``torch_ref.Scenario.inf_microbatches``' injection.
    """

    init_scale: float = 2.0**10
    growth_interval: int = 2
    inf_microbatches: tuple[tuple[int, int, int], ...] = ((3, 1, 0),)

    def poison(self, u: int, r: int, m: int) -> bool:
        return (u, r, m) in self.inf_microbatches


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One training run, described entirely by numbers (see module docstring).

    Attributes:
      world: data-parallel ranks R.
      k: micro-batches per rank per window.
      unit: loss unit, "token" (valid tokens) or "sample" (samples with a valid token).
      dtype: "float32", "float64" (CPU) or "bfloat16" (autocast/compute dtype; CUDA).
      n_updates: optimizer updates (windows).
      short_window: index ``u`` of an epoch-end window: half the samples, and
        ``k_short`` micro-batches per rank instead of ``k``; it must be
        normalized by its own count.
      k_short: micro-batches per rank of the short window (``1 <= k_short <= k``).
      samples_per_update: rows of each global batch S.
      seq_len: padded length T (<= block_size).
      opt: the optimizer.
      data_seed: seed of the data (the weights are the suite's, see ``flax_gpt.init_state_dict``).
      loss_scaling: a :class:`LossScaling` (dynamic loss scale and injected overflows), or None.
    """

    world: int = 1
    k: int = 1
    unit: str = "token"
    dtype: str = "float32"
    n_updates: int = 5
    short_window: int | None = None
    k_short: int = 1
    samples_per_update: int = 16
    seq_len: int = 128
    opt: Optimizer = Optimizer()
    data_seed: int = 0
    loss_scaling: LossScaling | None = None

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"unit: expected one of {UNITS}, got {self.unit!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if self.world < 1 or self.k < 1:
            raise ValueError(f"world, k: expected ints >= 1, got world={self.world}, k={self.k}")
        if self.short_window is not None and not 0 <= self.short_window < self.n_updates:
            raise ValueError(
                f"short_window: expected a window index in [0, {self.n_updates}), "
                f"got {self.short_window}"
            )
        if not 1 <= self.k_short <= self.k:
            raise ValueError(f"k_short: expected 1 <= k_short <= k={self.k}, got {self.k_short}")

    @property
    def name(self) -> str:
        parts = [f"R{self.world}k{self.k}", self.unit, self.dtype]
        if self.short_window is not None:
            parts.append(f"short{self.short_window}" + (f"x{self.k_short}" if self.k > 1 else ""))
        if self.opt.schedule != "constant":
            parts.append(self.opt.schedule)
        if self.opt.max_grad_norm is not None:
            parts.append(f"clip{self.opt.max_grad_norm:g}")
        if self.loss_scaling is not None:
            parts.append("fp16scale-fp32compute")
        return "-".join(parts)

    @property
    def short_name(self) -> str:
        """``R2k2-token-f32`` (``-fp16scale`` with loss scaling): the report's scenario id.

        The suite's scenarios share the rest of :attr:`name` (the short window, the
        schedule, the clipping); the report's legend says it once.
        """
        scaled = "-fp16scale" if self.loss_scaling is not None else ""
        return f"R{self.world}k{self.k}-{self.unit}-{DTYPE_IDS[self.dtype]}{scaled}"

    def window_ks(self) -> list[int]:
        """Micro-batches per rank of each window (``k``, or ``k_short`` for the short one)."""
        return [self.k_short if u == self.short_window else self.k for u in range(self.n_updates)]

    def rows_per_window(self) -> list[int]:
        """Samples in the global batch of each window (half of them in the short one)."""
        return [
            self.samples_per_update // 2 if u == self.short_window else self.samples_per_update
            for u in range(self.n_updates)
        ]

    def big_batch(self) -> Scenario:
        """The same data and optimizer on one device, one micro-batch per update
        (no loss scaling: nothing overflows in the big batch)."""
        return dataclasses.replace(self, world=1, k=1, k_short=1, loss_scaling=None)


def global_batches(scn: Scenario) -> list[tuple[np.ndarray, np.ndarray]]:
    """The global batch ``(tokens, labels)`` ``[S_u, T]`` int32 of every update ``u``.

    ``tinygpt.data.skewed_batch`` drawn in turn from one generator seeded with
    ``data_seed``: the batches depend only on ``data_seed``, ``samples_per_update``,
    ``seq_len``, ``n_updates`` and the short window (never on the layout), so every
    layout of a scenario, and its big batch, train on the same samples. The short
    window holds ``S // 2`` samples.
    """
    rng = np.random.default_rng(scn.data_seed)
    return [data.skewed_batch(rng, rows=n, seq_len=scn.seq_len) for n in scn.rows_per_window()]


def layouts(scn: Scenario) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every window of the scenario laid out, ``(tokens, labels)`` ``[R, k_u, mb, T]``.

    ``tinygpt.data.split_batches`` of the global batches (see the module
    docstring): all windows share one ``mb``, so that a jitted step compiles once
    per scenario; the extra rows are padding. The big batch (``R = k = 1``) holds
    each global batch in order, padded to that ``mb``.
    """
    return data.split_batches(global_batches(scn), scn.world, scn.window_ks())
