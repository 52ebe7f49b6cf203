"""One optimizer update from a window of micro-batches: the reference algorithm.

The big-batch loss of a window of k micro-batches on each of R ranks is

    L = (sum over ranks r, micro-batches m, items i of l_rmi) / N
    N = the items (valid shifted tokens, or samples) of ALL micro-batches of ALL
        ranks in the window

and `train_update` computes exactly grad L (``docs/math.md``), top to bottom:

1. count the window's items from the labels, before any backward, and
   all-reduce them (SUM);
2. per micro-batch: forward, the summed loss, backward of ``loss_sum * R / N``
   (DistributedDataParallel then AVERAGES over the R ranks, which leaves
   ``sum_r loss_sum_r / N``), with ``no_sync()`` around the forward AND the
   backward of all but the last micro-batch (one gradient all-reduce per window);
3. at the boundary, once: GradScaler unscale -> global norm -> clip
   (``clip_grad_norm_``'s formula) -> step -> scaler update;
4. the scheduler, ``update_id`` and ``cumulative_items`` advance only when the
   optimizer really stepped.

A short (tail) window is normalized by its own items, like any window. The
known bugs are the same loop with other choices at its five decision points
(`torch_ref.buggy`, ``variant=``): the loop asks the `Variant`'s hooks there
(``divisors``, ``objective_scale``, ``no_sync_scopes``, ``backward``,
``clip_window``, ``after_microbatch``, ``after_window``); the reference's
hooks make the choices above.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from torch_ref import _steps as steps
from torch_ref._loss import UNITS, count_items
from torch_ref._record import Progress, SkipReason, record
from torch_ref._steps import Microbatch
from torch_ref.buggy import REFERENCE, Variant


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
    progress: Progress | None = None,
    autocast_dtype: torch.dtype | None = None,
    variant: Variant = REFERENCE,
    nominal_k: int | None = None,
) -> dict[str, Any]:
    """Applies one optimizer update equal to the big-batch update of the window.

    Math (``docs/math.md``), with N the window's items (all micro-batches, all
    ranks) and R the world size: micro-batch m backpropagates ``loss_sum_m * R / N``
    and DDP averages over the ranks, so the optimizer steps once on

        g = grad(sum of all loss sums) / N,   g <- g * min(1, max_grad_norm / (||g||_2 + 1e-6))

    (the clip only with ``max_grad_norm``). A window whose norm or loss is not
    finite is skipped (a GradScaler also backs its scale off), and so is an empty
    one with ``empty_window="skip"``: no step, no scheduler step.

    Args:
      model: maps ``input_ids`` [B, T] to logits [B, T, V]; plain (world size 1)
        or DistributedDataParallel (collectives over its process group).
      microbatches: this rank's micro-batches; dicts of ``input_ids`` and
        ``labels`` ([B, T] int64, -100 = no loss, shifted by the loss), moved to
        the model's device. Every rank passes the same number.
      optimizer: any torch optimizer over the model's parameters.
      scheduler: an optional LR scheduler, stepped once per APPLIED update.
      max_grad_norm: clip the window gradient to this global L2 norm (None: no clip).
      scaler: an optional ``torch.amp.GradScaler``: the loss is scaled per
        micro-batch, unscaled once at the boundary (a disabled one does nothing).
      unit: "token" or "sample" (`torch_ref.causal_lm_loss_sum`).
      empty_window: "raise" (ValueError when N == 0) or "skip".
      progress: the `Progress` counters, mutated in place (a fresh one if None).
      autocast_dtype: None, torch.bfloat16 or torch.float16: the forward under
        ``torch.autocast``; the loss in float32.
      variant: `torch_ref.buggy.REFERENCE`, or a bug of ``buggy.VARIANTS``.
      nominal_k: the configured micro-batches per window (only for a variant
        with ``tail_divisor="nominal_k"``).

    Returns:
      the window record, keys `RECORD_KEYS` (those of ``jaxaccum.WindowMetrics``
      plus ``learning_rate``): ``micro_step``, ``update_id`` (after this window),
      ``window_items`` (N), ``cumulative_items`` (N summed over applied windows),
      ``loss`` (global loss sum / N; under a bug, the value of its objective),
      ``grad_norm`` and ``grad_norm_clipped`` (before and after clipping,
      unscaled), ``skipped``, ``skip_count``, ``skip_reason`` (a `SkipReason`),
      ``loss_scale`` (the GradScaler's scale for the NEXT window; 1.0 without)
      and ``learning_rate`` (the LR of param group 0 this update used, or would
      have). An empty window records a NaN loss (it has no mean); a non-finite
      one what it computed, with ``grad_norm_clipped == grad_norm``.

    Raises:
      ValueError: a bad argument, ranks with different numbers of micro-batches,
        or an empty window with ``empty_window="raise"``.

    Example:
      >>> model = nn.Sequential(nn.Embedding(256, 16), nn.Linear(16, 256))  # [B,T] -> [B,T,V]
      >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
      >>> ids = torch.randint(0, 256, (2, 16))
      >>> rec = train_update(model, [{"input_ids": ids, "labels": ids}], opt)
      >>> rec["update_id"], rec["window_items"]
      (1, 30.0)
    """
    _check_arguments(microbatches, unit, empty_window, variant, max_grad_norm, scaler, nominal_k)
    progress = progress if progress is not None else Progress()
    ddp, world_size, params, device = steps.placement(model)
    batches = [{key: mb[key].to(device) for key in ("input_ids", "labels")} for mb in microbatches]
    k = len(batches)

    # 1. Count the window's items before any backward; all-reduce (SUM).
    items = [count_items(mb["labels"], unit) for mb in batches]
    window_items = steps.window_items(ddp, world_size, items, device)
    optimizer.zero_grad(set_to_none=True)
    if window_items == 0:
        schedule = (variant, scheduler)
        return _skip_empty_window(progress, k, unit, empty_window, optimizer, scaler, schedule)

    # 2. Per micro-batch: forward, summed loss, backward of loss_sum * R / N. The variant's
    # hooks make the choices: divisors (decision 5), objective_scale (1), no_sync_scopes (2),
    # backward (3), after_microbatch (4).
    divisors = variant.divisors(window_items, float(sum(items)), k, nominal_k)
    objective_sum = torch.zeros((), dtype=torch.float64, device=device)
    for m, mb in enumerate(batches):
        scale = variant.objective_scale(divisors, items[m], world_size)
        forward_scope, backward_scope = variant.no_sync_scopes(ddp, last=m == k - 1)
        with forward_scope:
            loss_sum = steps.forward_loss_sum(model, mb, unit, autocast_dtype)
            with backward_scope:
                added = variant.backward(loss_sum * scale, params, scaler, max_grad_norm)
        if added:  # the reference adds every micro-batch (decision 3 may drop one)
            objective_sum += loss_sum.detach().to(torch.float64) * scale
        variant.after_microbatch(scheduler)

    # 3. At the boundary, once: the window loss, unscale, norm, clip (decision 3), step.
    # the objective whose gradient DDP averaged: sum / N for the reference
    loss = steps.sum_over_ranks(ddp, [objective_sum], device)[0] / world_size
    grad_norm = steps.unscaled_norm(optimizer, scaler, params)
    finite = math.isfinite(grad_norm) and math.isfinite(loss)
    clip_coef = variant.clip_window(params, grad_norm, max_grad_norm) if finite else 1.0
    lr = float(optimizer.param_groups[0]["lr"])  # the LR this step uses
    skipped, loss_scale = steps.optimizer_step(optimizer, scaler, finite)

    # 4. The counters and the scheduler (decision 4) advance only with a real update.
    reason = SkipReason.NONFINITE if skipped else SkipReason.APPLIED
    progress.advance(k, window_items, reason)
    variant.after_window(scheduler, applied=not skipped)
    clipped = grad_norm if skipped else grad_norm * clip_coef
    return record(progress, window_items, loss, grad_norm, clipped, reason, lr, loss_scale)


def _check_arguments(
    microbatches: Sequence[Microbatch],
    unit: str,
    empty_window: str,
    variant: Variant,
    max_grad_norm: float | None,
    scaler: torch.amp.GradScaler | None,
    nominal_k: int | None,
) -> None:
    """Raises ValueError, naming the argument, for what `train_update` cannot run."""
    if unit not in UNITS:
        raise ValueError(f"unit: expected one of {UNITS}, got {unit!r}")
    if empty_window not in ("raise", "skip"):
        raise ValueError(f"empty_window: expected 'raise' or 'skip', got {empty_window!r}")
    if not isinstance(variant, Variant):
        raise ValueError(f"variant: expected a torch_ref.buggy.Variant, got {variant!r}")
    number = isinstance(max_grad_norm, numbers.Real) and not isinstance(max_grad_norm, bool)
    if max_grad_norm is not None and not (number and max_grad_norm > 0):  # NaN is not > 0
        raise ValueError(
            f"max_grad_norm: expected None (no clipping) or a number > 0, got {max_grad_norm!r}"
        )
    variant.check(max_grad_norm, scaler, nominal_k)
    if len(microbatches) == 0:
        raise ValueError("microbatches: expected at least one micro-batch in the window")


def _skip_empty_window(
    progress: Progress,
    k: int,
    unit: str,
    empty_window: str,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    schedule: tuple[Variant, Any | None],
) -> dict[str, Any]:
    """The record of a window without items (no step; NaN loss), or ValueError for "raise".

    ``schedule``: the variant and the scheduler, which steps as the variant says (after
    each of the ``k`` micro-batches too, for a schedule per micro-batch) after the record.
    """
    if empty_window == "raise":
        raise ValueError(
            f"microbatches: the window has no items (unit={unit!r}: no label != -100 after "
            f"the causal shift on any rank); pass empty_window='skip' to skip it"
        )
    progress.advance(k, 0.0, SkipReason.EMPTY)
    lr = float(optimizer.param_groups[0]["lr"])
    loss_scale = float(scaler.get_scale()) if scaler is not None else 1.0
    skipped = record(progress, 0.0, math.nan, 0.0, 0.0, SkipReason.EMPTY, lr, loss_scale)
    variant, scheduler = schedule
    for _ in range(k):
        variant.after_microbatch(scheduler)
    variant.after_window(scheduler, applied=False)
    return skipped


def windows_of(
    microbatches: Iterable[Microbatch], k: int, *, drop_last: bool = False
) -> list[list[Microbatch]]:
    """Cuts a stream of micro-batches into consecutive windows of k (the last may be shorter).

    Args:
      microbatches: this rank's micro-batches in order.
      k: micro-batches per window (>= 1).
      drop_last: drop a final window shorter than k (else keep it as is).

    Returns:
      the list of windows (each a list of 1..k micro-batches).
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected an int >= 1, got {k!r}")
    items = list(microbatches)
    windows = [items[i : i + k] for i in range(0, len(items), k)]
    return windows[:-1] if windows and drop_last and len(windows[-1]) < k else windows


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

    The tail window (fewer than k micro-batches) is normalized by its own items,
    like any window, or dropped with ``drop_last=True``.

    Args:
      model, optimizer: as in `train_update`.
      microbatches: this rank's micro-batches, in order (under DDP every rank
        yields the same number).
      k: micro-batches per window on each rank (also the ``nominal_k`` passed on).
      drop_last: drop a short final window.
      progress: counters to continue from (a fresh `Progress` if None).
      **update_kwargs: the other keyword arguments of `train_update`.

    Returns:
      the window records (`train_update`), skipped windows included.
    """
    progress = progress if progress is not None else Progress()
    update_kwargs.setdefault("nominal_k", k)
    records = [
        train_update(model, window, optimizer, progress=progress, **update_kwargs)
        for window in windows_of(microbatches, k, drop_last=drop_last)
    ]
    ddp, world_size, _, device = steps.placement(model)
    if world_size > 1:  # the end, agreed: a rank with a window left raises, not gloo's error
        steps.window_items(ddp, world_size, [], device)
    return records
