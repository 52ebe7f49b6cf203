"""One optimizer update from a window of micro-batches: the reference algorithm.

The big-batch loss of a window of k micro-batches on each of R ranks is

    L = (sum over ranks r, micro-batches m, units u of l_rmu) / N
    N = number of loss units (valid shifted tokens, or samples) over ALL
        micro-batches of ALL ranks in the window.

`train_update` computes exactly grad L, straight from the reference
(references/001): count N from the labels BEFORE the first backward and
all-reduce it (SUM); per micro-batch backward of ``loss_sum * R / N``
(DistributedDataParallel then AVERAGES over the R ranks, which leaves
``sum_r loss_sum_r / N``); ``no_sync()`` around forward AND backward of all but
the last micro-batch (one gradient all-reduce per window); at the boundary,
once: unscale (fp16 GradScaler) -> global norm -> clip -> step -> scaler update.
The scheduler, the EMA, ``update_id`` and ``cumulative_items`` advance only when
the optimizer really stepped.

`train` cuts a stream of micro-batches into windows of k (tail window
normalized by its real count, or dropped).

The buggy variants of DESIGN.md are one switch away (``bug=...``); see
`torch_ref.buggy` for what each does and where it was seen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_ref._loss import UNITS, causal_lm_loss_sum, count_items
from torch_ref._model import _unwrap

Microbatch = dict[str, torch.Tensor]

# The bug switches (documented one by one in torch_ref.buggy).
MEAN_OF_MEANS = "mean_of_means"
MISSING_1_OVER_K = "missing_1_over_k"
LOCAL_DENOMINATOR = "local_denominator"
DDP_AVERAGE_FORGOTTEN = "ddp_average_forgotten"
CLIP_PER_MICROBATCH = "clip_per_microbatch"
FIXED_DIVISOR_TAIL = "fixed_divisor_tail"
SCHEDULER_PER_MICROBATCH = "scheduler_per_microbatch"
NO_SYNC_BACKWARD_ONLY = "no_sync_backward_only"
BUG_NAMES: tuple[str, ...] = (
    MEAN_OF_MEANS,
    MISSING_1_OVER_K,
    LOCAL_DENOMINATOR,
    DDP_AVERAGE_FORGOTTEN,
    CLIP_PER_MICROBATCH,
    FIXED_DIVISOR_TAIL,
    SCHEDULER_PER_MICROBATCH,
    NO_SYNC_BACKWARD_ONLY,
)

RECORD_KEYS: tuple[str, ...] = (
    "micro_step",
    "update_id",
    "window_items",
    "cumulative_items",
    "loss",
    "grad_norm",
    "grad_norm_clipped",
    "skipped",
    "skip_count",
    "skip_reason",
    "loss_scale",
    "learning_rate",
)


class SkipReason(enum.IntEnum):
    """``record["skip_reason"]``: the values of ``jaxaccum.SkipReason`` (checked by the parity tests)."""

    APPLIED = 0
    EMPTY = 1  # the window's global number of items was 0
    NONFINITE = 2  # the window gradient or loss was NaN or inf


@dataclasses.dataclass
class Progress:
    """Counters carried between windows (mutated in place by `train_update`).

    Attributes:
      micro_step: micro-batches processed on this rank since the start (int).
      update_id: optimizer updates really applied (int; a skipped window does
        not count).
      cumulative_items: global loss units summed over all APPLIED windows (float).
      skip_count: windows skipped so far (empty or non-finite) (int).
    """

    micro_step: int = 0
    update_id: int = 0
    cumulative_items: float = 0.0
    skip_count: int = 0


class EMA:
    """Exponential moving average of a model's parameters.

    Math: after each applied update, ``shadow <- decay * shadow + (1 - decay) * param``
    (shadow in float32, or float64 for float64 parameters; initialized to the
    parameters at construction).

    Args:
      model: the module (or DDP wrapper) whose parameters are tracked.
      decay: in [0, 1).

    Attributes:
      shadow: {name: float32 tensor}, the averaged parameters.
      num_updates: how many times `update` ran.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay: expected a float in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self.num_updates = 0
        self.shadow: dict[str, torch.Tensor] = {
            name: p.detach().to(_at_least_f32(p.dtype)).clone()
            for name, p in _unwrap(model).named_parameters()
        }

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One EMA step from the model's current parameters."""
        for name, p in _unwrap(model).named_parameters():
            shadow = self.shadow[name]
            shadow.mul_(self.decay).add_(p.detach().to(shadow.dtype), alpha=1.0 - self.decay)
        self.num_updates += 1


def _at_least_f32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _no_sync(
    ddp: nn.parallel.DistributedDataParallel | None, on: bool
) -> contextlib.AbstractContextManager[Any]:
    """``ddp.no_sync()`` when asked for and DDP is there, else a no-op context."""
    return ddp.no_sync() if ddp is not None and on else contextlib.nullcontext()


def _global_norm(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients, sqrt(sum_p ||g_p||^2), in float32 (or float64)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch.stack([torch.linalg.vector_norm(g.to(_at_least_f32(g.dtype))) for g in grads])
    return torch.linalg.vector_norm(norms)


@torch.no_grad()
def _scale_grads(params: Sequence[nn.Parameter], coef: float) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)


def _clip_coef(norm: float, max_norm: float) -> float:
    """``min(1, max_norm / (norm + 1e-6))``: ``torch.nn.utils.clip_grad_norm_``'s factor."""
    return min(1.0, max_norm / (norm + 1e-6))


def _objective(
    bug: str | None,
    loss_sum: torch.Tensor,
    *,
    micro_count: int,
    local_count: float,
    global_count: float,
    world_size: int,
    n_micro: int,
    nominal_k: int | None,
) -> torch.Tensor:
    """The scalar one micro-batch backpropagates (before any loss scaling).

    Correct path: ``loss_sum * R / N``; DDP's average over R ranks then gives
    the gradient of ``sum_r,m loss_sum_rm / N``. Each bug changes this one line.
    """
    if bug == MEAN_OF_MEANS:  # micro-batch mean, averaged over the k micro-batches
        return (loss_sum / micro_count if micro_count else loss_sum * 0.0) / n_micro
    if bug == MISSING_1_OVER_K:  # micro-batch mean, NOT divided by k
        return loss_sum / micro_count if micro_count else loss_sum * 0.0
    if bug == LOCAL_DENOMINATOR:  # each rank divides by its own count
        return loss_sum / local_count if local_count else loss_sum * 0.0
    if bug == DDP_AVERAGE_FORGOTTEN:  # no x R against DDP's average
        return loss_sum / global_count
    if bug == FIXED_DIVISOR_TAIL:  # a short window is still divided by k windows' worth
        assert nominal_k is not None
        return loss_sum * world_size / (global_count * nominal_k / n_micro)
    return loss_sum * (world_size / global_count)


def train_update(
    model: nn.Module,
    microbatches: Sequence[Microbatch],
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: Any | None = None,
    max_grad_norm: float | None = None,
    scaler: torch.amp.GradScaler | None = None,
    unit: str = "token",
    empty_window: str = "raise",
    ema: EMA | None = None,
    progress: Progress | None = None,
    autocast_dtype: torch.dtype | None = None,
    bug: str | None = None,
    nominal_k: int | None = None,
) -> dict[str, Any]:
    """Applies one optimizer update equal to the big-batch update of the window.

    Math: with N the global number of loss units of the window (all
    micro-batches, all ranks) and R the world size, every micro-batch
    backpropagates ``loss_sum * R / N``; DDP averages over ranks, so the
    optimizer sees ``g = grad (sum of all loss sums) / N``. Then, once:
    ``grad_norm = ||g||_2``; if ``max_grad_norm``: ``g <- g * min(1, max_grad_norm / grad_norm)``;
    step; the scheduler, EMA, ``update_id``, ``cumulative_items`` advance only if
    the optimizer really stepped.

    A window is skipped (``skipped=True``, no optimizer/scheduler/EMA step) when
    its gradient norm or loss is not finite (with a GradScaler: the scaler also
    backs its scale off), or when it is empty and ``empty_window="skip"``.
    Collectives (count and loss
    all-reduces, DDP's gradient all-reduce) happen only when ``model`` is
    DistributedDataParallel; a plain module is world size 1. Every rank must
    pass the same number of micro-batches (checked: ValueError otherwise).

    Args:
      model: TinyGPT-like module mapping ``input_ids`` [B, T] -> logits [B, T, V],
        plain or DistributedDataParallel-wrapped. The device is that of its
        parameters; micro-batch tensors are moved there.
      microbatches: this rank's micro-batches of the window; dicts with
        ``input_ids`` and ``labels`` ([B, T] int64; -100 = no loss; the causal
        shift happens in the loss). T may differ between micro-batches.
      optimizer: any torch optimizer over the model's parameters.
      scheduler: optional LR scheduler, stepped once per APPLIED update.
      max_grad_norm: clip the window gradient to this global L2 norm (None: no clip).
      scaler: optional enabled ``torch.amp.GradScaler`` (fp16): scale(loss).backward()
        per micro-batch, then unscale_ once, clip, scaler.step, scaler.update.
      unit: "token" or "sample" (see `torch_ref.causal_lm_loss_sum`).
      empty_window: "raise" (ValueError when N == 0) or "skip" (no step; only
        ``micro_step`` advances).
      ema: optional `EMA`, updated after each applied step.
      progress: the `Progress` counters, mutated in place (a fresh one if None).
      autocast_dtype: None (no autocast), torch.bfloat16 or torch.float16:
        forward under ``torch.autocast(device_type, dtype)``; loss in float32.
      bug: None for the correct path, or one of `torch_ref.buggy.BUG_NAMES`.
      nominal_k: the configured micro-batches per window; only used (and
        required) by ``bug="fixed_divisor_tail"``.

    Returns:
      the window record, a dict (keys and meanings of ``jaxaccum.window_metrics``,
      plus ``learning_rate``):
        micro_step (int): micro-batches on this rank since the start, after this window;
        update_id (int): updates really applied so far (unchanged when skipped);
        window_items (float): N, global loss units of this window;
        cumulative_items (float): sum of N over all APPLIED windows so far;
        loss (float): window mean loss, global loss sum / N. Under a ``bug`` it
          is the value of the (buggy) objective whose gradient the optimizer
          received (e.g. k x the mean for missing_1_over_k);
        grad_norm (float): global L2 norm of the window gradient (normalized,
          unscaled) before clipping;
        grad_norm_clipped (float): the same after clipping (== grad_norm if no clip);
        skipped (bool): True when no optimizer step was applied;
        skip_count (int): windows skipped so far, this one included;
        skip_reason (int): 0 applied, 1 empty window, 2 non-finite gradient/loss;
        loss_scale (float): the GradScaler scale for the NEXT window (after this
          boundary's ``scaler.update()``; 1.0 without a scaler);
        learning_rate (float): LR of param group 0 used (or that would have been
          used) for this update.
      As in jaxaccum, an empty window records a NaN loss (it has no mean) and a
      non-finite one records what it computed (its NaN or inf norm or loss), with
      ``grad_norm_clipped == grad_norm``: nothing was clipped.

    Raises:
      ValueError: bad ``unit``/``empty_window``/``bug``, ranks with different
        numbers of micro-batches, or an empty window with ``empty_window="raise"``.

    Example:
      >>> from torch_ref import TinyGPT, TinyGPTConfig
      >>> model = TinyGPT(TinyGPTConfig(block_size=16))
      >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
      >>> ids = torch.randint(0, 256, (2, 16))
      >>> rec = train_update(model, [{"input_ids": ids, "labels": ids}], opt)
      >>> rec["update_id"], rec["window_items"]
      (1, 30.0)
    """
    if unit not in UNITS:
        raise ValueError(f"unit: expected one of {UNITS}, got {unit!r}")
    if empty_window not in ("raise", "skip"):
        raise ValueError(f"empty_window: expected 'raise' or 'skip', got {empty_window!r}")
    if bug is not None and bug not in BUG_NAMES:
        raise ValueError(f"bug: expected None or one of {BUG_NAMES}, got {bug!r}")
    if bug == FIXED_DIVISOR_TAIL and not nominal_k:
        raise ValueError("nominal_k: bug='fixed_divisor_tail' needs the configured k (an int >= 1)")
    if bug == CLIP_PER_MICROBATCH and (max_grad_norm is None or scaler is not None):
        raise ValueError("bug='clip_per_microbatch' needs max_grad_norm and no scaler")
    if len(microbatches) == 0:
        raise ValueError("microbatches: expected at least one micro-batch in the window")
    if progress is None:
        progress = Progress()
    amp = scaler if scaler is not None and scaler.is_enabled() else None
    ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
    group = ddp.process_group if ddp is not None else None

    base = _unwrap(model)
    params = [p for p in base.parameters() if p.requires_grad]
    device = params[0].device
    world_size = dist.get_world_size(group) if ddp is not None else 1
    n_micro = len(microbatches)
    batches = [
        {"input_ids": mb["input_ids"].to(device), "labels": mb["labels"].to(device)}
        for mb in microbatches
    ]

    # 1. Count the window's loss units before any backward; all-reduce SUM.
    micro_counts = [count_items(mb["labels"], unit) for mb in batches]
    local_count = float(sum(micro_counts))
    stats = torch.tensor([local_count, float(n_micro)], dtype=torch.float64, device=device)
    if ddp is not None:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    global_count = float(stats[0].item())
    if int(stats[1].item()) != n_micro * world_size:
        raise ValueError(
            f"microbatches: every rank must pass the same number of micro-batches; this rank "
            f"has {n_micro}, the {world_size} ranks have {int(stats[1].item())} in total"
        )

    optimizer.zero_grad(set_to_none=True)
    lr = float(optimizer.param_groups[0]["lr"])
    loss_scale = float(amp.get_scale()) if amp is not None else 1.0

    if global_count == 0:
        if empty_window == "raise":
            raise ValueError(
                f"microbatches: the window has no loss units (unit={unit!r}: no label != -100 "
                f"after the causal shift on any rank); pass empty_window='skip' to skip it"
            )
        progress.micro_step += n_micro
        progress.skip_count += 1
        return _record(progress, 0.0, math.nan, 0.0, 0.0, SkipReason.EMPTY, lr, loss_scale)

    # 2. Micro-batch loop: sum-reduced loss, normalized once by the global count.
    def autocast() -> contextlib.AbstractContextManager[Any]:
        if autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=autocast_dtype)

    loss_sum_total = torch.zeros((), dtype=torch.float64, device=device)
    objective_total = torch.zeros((), dtype=torch.float64, device=device)
    for i, mb in enumerate(batches):
        last = i == n_micro - 1
        # Correct: no_sync() around forward AND backward of all but the last micro-batch.
        skip_sync = not last and bug != CLIP_PER_MICROBATCH
        forward_ctx = _no_sync(ddp, skip_sync and bug != NO_SYNC_BACKWARD_ONLY)
        backward_ctx = _no_sync(ddp, skip_sync and bug == NO_SYNC_BACKWARD_ONLY)
        with forward_ctx:
            with autocast():
                logits: torch.Tensor = model(mb["input_ids"])
            loss_sum, micro_count = causal_lm_loss_sum(logits, mb["labels"], unit)
            objective = _objective(
                bug,
                loss_sum,
                micro_count=micro_count,
                local_count=local_count,
                global_count=global_count,
                world_size=world_size,
                n_micro=n_micro,
                nominal_k=nominal_k,
            )
            with backward_ctx:
                if bug == CLIP_PER_MICROBATCH:
                    assert max_grad_norm is not None  # checked above
                    _backward_clipped(objective, params, max_grad_norm)
                else:
                    (amp.scale(objective) if amp is not None else objective).backward()
        loss_sum_total += loss_sum.detach().to(torch.float64)
        objective_total += objective.detach().to(torch.float64)
        if bug == SCHEDULER_PER_MICROBATCH and scheduler is not None:
            with warnings.catch_warnings():  # torch warns: scheduler before optimizer
                warnings.simplefilter("ignore")
                scheduler.step()

    # 3. Boundary, once: global loss, unscale, norm, clip, step.
    sums = torch.stack([loss_sum_total, objective_total])
    if ddp is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    if bug is None:
        loss = float(sums[0].item()) / global_count
    else:  # the value of the objective whose gradient DDP averaged over ranks
        loss = float(sums[1].item()) / world_size

    if amp is not None:
        amp.unscale_(optimizer)
    grad_norm = float(_global_norm(params).item())
    grad_norm_clipped = grad_norm
    finite = math.isfinite(grad_norm) and math.isfinite(loss)
    if max_grad_norm is not None and finite and bug != CLIP_PER_MICROBATCH:
        coef = _clip_coef(grad_norm, max_grad_norm)
        if coef < 1.0:
            _scale_grads(params, coef)
        grad_norm_clipped = grad_norm * coef
    if bug == SCHEDULER_PER_MICROBATCH:
        lr = float(optimizer.param_groups[0]["lr"])  # the LR the step really uses

    if amp is not None:
        if finite:
            amp.step(optimizer)  # would also skip optimizer.step() on inf/NaN grads
        amp.update()  # backs the scale off iff unscale_ found an inf/NaN
        skipped = not finite or amp.get_scale() < loss_scale
        loss_scale = float(amp.get_scale())  # the scale of the next window
    else:
        if finite:
            optimizer.step()
        skipped = not finite

    # 4. Counters advance only with a real update.
    progress.micro_step += n_micro
    if skipped:
        progress.skip_count += 1
        return _record(
            progress, global_count, loss, grad_norm, grad_norm, SkipReason.NONFINITE, lr, loss_scale
        )
    if scheduler is not None and bug != SCHEDULER_PER_MICROBATCH:
        scheduler.step()
    if ema is not None:
        ema.update(model)
    progress.update_id += 1
    progress.cumulative_items += global_count
    return _record(
        progress, global_count, loss, grad_norm, grad_norm_clipped, SkipReason.APPLIED, lr, loss_scale
    )


def _backward_clipped(
    objective: torch.Tensor, params: Sequence[nn.Parameter], max_norm: float
) -> None:
    """Bug clip_per_microbatch: backward, then clip THIS micro-batch's gradient alone."""
    stash = [p.grad for p in params]
    for p in params:
        p.grad = None
    objective.backward()
    coef = _clip_coef(float(_global_norm(params).item()), max_norm)
    with torch.no_grad():
        for p, acc in zip(params, stash, strict=True):
            if p.grad is not None:
                p.grad.mul_(coef)
                if acc is not None:
                    p.grad.add_(acc)
            else:
                p.grad = acc


def _record(
    progress: Progress,
    window_items: float,
    loss: float,
    grad_norm: float,
    grad_norm_clipped: float,
    skip_reason: int,
    lr: float,
    loss_scale: float,
) -> dict[str, Any]:
    return {
        "micro_step": progress.micro_step,
        "update_id": progress.update_id,
        "window_items": float(window_items),
        "cumulative_items": float(progress.cumulative_items),
        "loss": float(loss),
        "grad_norm": float(grad_norm),
        "grad_norm_clipped": float(grad_norm_clipped),
        "skipped": skip_reason != SkipReason.APPLIED,
        "skip_count": progress.skip_count,
        "skip_reason": int(skip_reason),
        "loss_scale": float(loss_scale),
        "learning_rate": float(lr),
    }


def windows_of(
    microbatches: Iterable[Microbatch], k: int, *, drop_last: bool = False
) -> list[list[Microbatch]]:
    """Cuts a stream of micro-batches into consecutive windows of k.

    Args:
      microbatches: this rank's micro-batches in order.
      k: micro-batches per window (>= 1).
      drop_last: drop a final window shorter than k (else keep it as is).

    Returns:
      the list of windows (each a list of 1..k micro-batches).
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected an int >= 1, got {k!r}")
    windows: list[list[Microbatch]] = []
    current: list[Microbatch] = []
    for mb in microbatches:
        current.append(mb)
        if len(current) == k:
            windows.append(current)
            current = []
    if current and not drop_last:
        windows.append(current)
    return windows


def train(
    model: nn.Module,
    microbatches: Iterable[Microbatch],
    optimizer: torch.optim.Optimizer,
    *,
    k: int,
    drop_last: bool = False,
    progress: Progress | None = None,
    **update_kwargs: Any,
) -> list[dict[str, Any]]:
    """Runs `train_update` over windows of k micro-batches; one record per window.

    The tail window (fewer than k micro-batches) is normalized by its real count
    N_tail, like any window (default), or dropped with ``drop_last=True``. Under
    DDP every rank must yield the same number of micro-batches.

    Args:
      model, optimizer: as in `train_update`.
      microbatches: this rank's micro-batches, in order.
      k: micro-batches per window on each rank.
      drop_last: drop a short final window instead of normalizing it by its count.
      progress: counters to continue from (a fresh `Progress` if None).
      **update_kwargs: forwarded to `train_update` (scheduler, max_grad_norm,
        scaler, unit, empty_window, ema, autocast_dtype, bug).

    Returns:
      the list of window records (see `train_update`), including skipped windows.
    """
    progress = progress if progress is not None else Progress()
    update_kwargs.setdefault("nominal_k", k)
    return [
        train_update(model, window, optimizer, progress=progress, **update_kwargs)
        for window in windows_of(microbatches, k, drop_last=drop_last)
    ]
