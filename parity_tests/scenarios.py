"""Scenarios: one numpy description of a training run, fed to both frameworks.

A :class:`Scenario` fixes everything that decides the numbers besides the
initial weights (numpy, from ``flax_gpt.init_state_dict``): the data (byte-level samples cut from ``corpus.txt`` with masked
prompts), the window layout (world size ``R``, micro-batches per window ``k``),
the loss unit (``token`` or ``sample``), the dtype and the optimizer (AdamW,
optionally with a warmup-cosine schedule and global-norm clipping).

Data. Update ``u`` consumes one *global batch* of ``samples_per_update`` rows
``[S, T]`` (``T = seq_len``). A sample is ``prompt + response`` bytes, right
padded; its labels are ``-100`` on the prompt and the padding, so after the
causal shift the number of valid tokens equals the response length. Response
lengths are deliberately skewed (the default batch of 16 holds 2 samples with
no valid token, 6 with 2-5, 2 with 20-40 and 6 with ~100), which is what makes
the mean-of-means and local-denominator bugs visible.

Layout. The same global batch is cut, for every ``(R, k)``, into ``R * k``
micro-batches of ``mb`` rows (:func:`layout`); rows without a sample are
padding rows (all labels ``-100``). The cut is chosen so that, whenever
``R * k > 1``: the ranks get different numbers of loss units (rank shares
grow as 1 : 2 : ... : R of the non-empty samples), and at least one
micro-batch has no valid token (it carries the batch's empty samples; with
``k = 1`` that is a whole rank, rank 0). Big batch: ``R = k = 1``.

Example::

    >>> scn = Scenario(world=2, k=2)
    >>> batches = global_batches(scn)          # n_updates x (tokens, labels) [S, T]
    >>> tok, lab = layout(*batches[0], world=2, k=2)
    >>> tok.shape[:2]                          # [R, k, mb, T]
    (2, 2)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib

import numpy as np

IGNORE_INDEX = -100
PAD_TOKEN = 0
UNITS = ("token", "sample")
DTYPES = ("float32", "float64", "bfloat16")
CORPUS_PATH = pathlib.Path(__file__).with_name("corpus.txt")


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW`` and ``optax.adamw``).

    ``schedule="constant"``: ``lr(u) = lr``. ``schedule="warmup_cosine"``: optax's
    ``warmup_cosine_decay_schedule(init_lr, lr, warmup, decay_steps, end_lr)`` of
    ``u`` = updates applied so far (never micro-steps), the same formula as
    ``torch_ref.WarmupCosine`` (:func:`learning_rate`).
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


def learning_rate(opt: Optimizer, update_id: int) -> float:
    """The learning rate of update ``update_id`` (0-based), see :class:`Optimizer`."""
    if opt.schedule == "constant":
        return opt.lr
    if opt.schedule != "warmup_cosine":
        raise ValueError(f"schedule: expected 'constant' or 'warmup_cosine', got {opt.schedule!r}")
    if update_id < opt.warmup:
        return opt.init_lr + (opt.lr - opt.init_lr) * update_id / opt.warmup
    span = max(opt.decay_steps - opt.warmup, 1)
    s = min(update_id - opt.warmup, span) / span
    return opt.end_lr + (opt.lr - opt.end_lr) * 0.5 * (1.0 + math.cos(math.pi * s))


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


@functools.lru_cache(maxsize=1)
def corpus_bytes() -> bytes:
    """The embedded corpus (``parity_tests/corpus.txt``) as bytes."""
    return CORPUS_PATH.read_bytes()


# Response-length classes of a global batch of 16: (how many, (low, high) valid tokens).
_LENGTH_MIX = ((2, (0, 0)), (6, (2, 5)), (2, (20, 40)), (6, (90, 110)))


def _sample(rng: np.random.Generator, text: bytes, n_valid: int, seq_len: int):
    """One row: prompt bytes (label -100) then ``n_valid`` response bytes, padded."""
    if n_valid == 0:  # a prompt so long that the response was truncated away
        prompt_len, resp_len = int(rng.integers(seq_len // 2, seq_len + 1)), 0
    else:
        prompt_len = int(rng.integers(4, max(5, min(24, seq_len - n_valid))))
        resp_len = n_valid
    length = prompt_len + resp_len
    start = int(rng.integers(0, len(text) - length))
    chunk = np.frombuffer(text[start : start + length], np.uint8).astype(np.int32)
    tokens = np.full(seq_len, PAD_TOKEN, np.int32)
    labels = np.full(seq_len, IGNORE_INDEX, np.int32)
    tokens[:length] = chunk
    labels[prompt_len:length] = chunk[prompt_len:]
    return tokens, labels


def _batch_rows(scn: Scenario, rng: np.random.Generator, n_rows: int):
    reps = max(1, math.ceil(n_rows / 16))
    lengths = []
    for n, (lo, hi) in _LENGTH_MIX:
        lengths += [int(rng.integers(lo, hi + 1)) for _ in range(n * reps)]
    lengths = [min(n, scn.seq_len - 5) for n in lengths]
    # Keep the mix (the empty samples first, so that a cut keeps at least one).
    empties = [n for n in lengths if n == 0][: max(1, round(n_rows * 2 / 16))]
    rest = [n for n in lengths if n > 0]
    rng.shuffle(rest)
    lengths = empties + rest[: n_rows - len(empties)]
    rng.shuffle(lengths)
    rows = [_sample(rng, corpus_bytes(), n, scn.seq_len) for n in lengths]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def global_batches(scn: Scenario) -> list[tuple[np.ndarray, np.ndarray]]:
    """The global batch ``(tokens, labels)`` ``[S_u, T]`` int32 of every update ``u``.

    Depends only on ``data_seed``, ``samples_per_update``, ``seq_len``,
    ``n_updates`` and the short window (never on the layout): every layout of a
    scenario, and its big batch, train on the same samples. The short window
    holds ``S // 2`` samples.
    """
    rng = np.random.default_rng(scn.data_seed)
    return [_batch_rows(scn, rng, n_rows) for n_rows in scn.rows_per_window()]


def valid_tokens(labels: np.ndarray) -> np.ndarray:
    """Valid tokens per row after the causal shift (labels[..., 1:] != -100)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum(-1)


def units(labels: np.ndarray, unit: str) -> np.ndarray:
    """Loss units per row: its valid tokens ("token") or 1 if it has any ("sample")."""
    n = valid_tokens(labels)
    return n if unit == "token" else (n > 0).astype(n.dtype)


def _split(n: int, weights: list[float]) -> list[int]:
    """``n`` items into len(weights) integer parts proportional to ``weights`` (largest remainder)."""
    total = sum(weights)
    raw = [n * w / total for w in weights]
    parts = [math.floor(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - parts[i], reverse=True)
    for i in order[: n - sum(parts)]:
        parts[i] += 1
    return parts


def assignment(n_valid: np.ndarray, world: int, k: int) -> list[list[list[int]]]:
    """Which rows of the global batch go to rank ``r``, micro-batch ``m``: ``[R][k][rows]``.

    Rules (module docstring): non-empty rows are dealt to ranks in proportions
    1 : 2 : ... : R (``k > 1``) or 0 : 1 : ... : R-1 (``k == 1``, rank 0 then gets
    only the empty rows), in batch order; within a rank evenly over its
    micro-batches. The empty rows (no valid token) form their own micro-batch:
    the last one of the last rank (``k > 1``) or rank 0's only one (``k == 1``).
    """
    rows = list(range(len(n_valid)))
    empty = [i for i in rows if n_valid[i] == 0]
    full = [i for i in rows if n_valid[i] > 0]
    plan = [[[] for _ in range(k)] for _ in range(world)]
    if world * k == 1:
        plan[0][0] = rows
        return plan
    if k == 1:
        shares = _split(len(full), [float(r) for r in range(world)])
        empty_slot = (0, 0)
    else:
        shares = _split(len(full), [float(r + 1) for r in range(world)])
        empty_slot = (world - 1, k - 1)
    start = 0
    for r in range(world):
        mine = full[start : start + shares[r]]
        start += shares[r]
        slots = [m for m in range(k) if (r, m) != empty_slot]
        per_slot = _split(len(mine), [1.0] * len(slots))
        s = 0
        for m, n in zip(slots, per_slot):
            plan[r][m] = mine[s : s + n]
            s += n
    plan[empty_slot[0]][empty_slot[1]] = empty
    return plan


def layout(tokens: np.ndarray, labels: np.ndarray, world: int, k: int, min_rows: int = 1):
    """Cuts a global batch ``[S, T]`` into ``[R, k, mb, T]`` micro-batches (+ padding rows).

    Returns:
      ``(tokens, labels)`` of shape ``[world, k, mb, T]``, ``mb`` the largest number
      of rows any micro-batch needs (at least ``min_rows``); padding rows have
      token ``PAD_TOKEN`` and labels ``-100`` everywhere (no loss unit, no gradient).
    """
    plan = assignment(valid_tokens(labels), world, k)
    mb = max(min_rows, max(len(rows) for rank in plan for rows in rank))
    t = tokens.shape[-1]
    out_tok = np.full((world, k, mb, t), PAD_TOKEN, tokens.dtype)
    out_lab = np.full((world, k, mb, t), IGNORE_INDEX, labels.dtype)
    for r in range(world):
        for m in range(k):
            rows = plan[r][m]
            out_tok[r, m, : len(rows)] = tokens[rows]
            out_lab[r, m, : len(rows)] = labels[rows]
    return out_tok, out_lab


def layouts(scn: Scenario) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every window of the scenario laid out, ``(tokens, labels)`` ``[R, k_u, mb, T]``.

    All windows share one ``mb`` (the largest needed), so that a jitted step
    compiles once per scenario; the extra rows are padding.
    """
    batches = global_batches(scn)
    plans = [
        assignment(valid_tokens(lab), scn.world, k_u)
        for (_, lab), k_u in zip(batches, scn.window_ks())
    ]
    mb = max(len(rows) for plan in plans for rank in plan for rows in rank)
    return [
        layout(tok, lab, scn.world, k_u, mb) for (tok, lab), k_u in zip(batches, scn.window_ks())
    ]
