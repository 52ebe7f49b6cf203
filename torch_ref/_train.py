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
(`torch_ref.buggy`, ``variant=``); the comments ``# decision n`` mark them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_ref import _steps as steps
from torch_ref._loss import causal_lm_loss_sum, count_items
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

    Math: with N the window's items (all micro-batches, all ranks) and R the world
    size, each micro-batch backpropagates ``loss_sum * R / N``; DDP averages, so
    the optimizer sees ``g = grad(sum of all loss sums) / N``. Then once:
    ``grad_norm = ||g||_2``; with ``max_grad_norm``, ``g <- g * min(1,
    max_grad_norm / (grad_norm + 1e-6))``; step. A window whose norm or loss is
    not finite is skipped (a GradScaler also backs its scale off), and so is an
    empty one with ``empty_window="skip"``: no step, no scheduler step.

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
        micro-batch, unscaled once at the boundary.
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
    steps.check_arguments(
        microbatches, unit, empty_window, variant, max_grad_norm, scaler, nominal_k
    )
    progress = progress if progress is not None else Progress()
    ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
    group = ddp.process_group if ddp is not None else None
    world_size = dist.get_world_size(group) if ddp is not None else 1
    amp = scaler if scaler is not None and scaler.is_enabled() else None
    params = [p for p in steps.unwrap(model).parameters() if p.requires_grad]
    device = params[0].device
    batches = [{key: mb[key].to(device) for key in ("input_ids", "labels")} for mb in microbatches]
    k = len(batches)

    # 1. Count the window's items before any backward; all-reduce (SUM).
    microbatch_items = [count_items(mb["labels"], unit) for mb in batches]
    rank_items = float(sum(microbatch_items))
    window_items, ranks_k = steps.sum_over_ranks(ddp, [rank_items, float(k)], device)
    if ranks_k != k * world_size:
        raise ValueError(
            f"microbatches: every rank must pass the same number of micro-batches; this rank "
            f"has {k}, the {world_size} ranks have {int(ranks_k)} in total"
        )
    optimizer.zero_grad(set_to_none=True)
    loss_scale = float(amp.get_scale()) if amp is not None else 1.0
    if window_items == 0:
        if empty_window == "raise":
            raise ValueError(
                f"microbatches: the window has no items (unit={unit!r}: no label != -100 after "
                f"the causal shift on any rank); pass empty_window='skip' to skip it"
            )
        progress.micro_step += k
        progress.skip_count += 1
        lr = float(optimizer.param_groups[0]["lr"])
        return record(progress, 0.0, math.nan, 0.0, 0.0, SkipReason.EMPTY, lr, loss_scale)

    # decision 5: variant.tail_divisor: the divisors of this window, or of a nominal_k one.
    stretch = nominal_k / k if variant.tail_divisor == "nominal_k" else 1.0

    # 2. Per micro-batch: forward, summed loss, backward of loss_sum * R / N.
    objective_sum = torch.zeros((), dtype=torch.float64, device=device)
    for m, mb in enumerate(batches):
        # decision 1: variant.objective, the factor of this micro-batch's summed loss
        scale = steps.objective_scale(
            variant.objective,
            world_size=world_size,
            window_items=window_items * stretch,
            rank_items=rank_items * stretch,
            microbatch_items=microbatch_items[m],
            k=k * stretch,
        )
        # decision 2: variant.no_sync, what no_sync() wraps
        forward_scope, backward_scope = steps.no_sync_scopes(ddp, variant.no_sync, m == k - 1)
        with forward_scope:
            with steps.autocast(device, autocast_dtype):
                logits = model(mb["input_ids"])
            loss_sum, _ = causal_lm_loss_sum(logits, mb["labels"], unit)
            objective = loss_sum * scale
            with backward_scope:
                if variant.clip == "per_microbatch":  # decision 3: variant.clip (see below)
                    steps.backward_clipped(objective, params, max_grad_norm)
                else:
                    (amp.scale(objective) if amp is not None else objective).backward()
        objective_sum += loss_sum.detach().to(torch.float64) * scale
        # decision 4: variant.scheduler, when the scheduler steps (see below)
        if variant.scheduler == "per_microbatch" and scheduler is not None:
            with warnings.catch_warnings():  # torch warns: scheduler before optimizer
                warnings.simplefilter("ignore")
                scheduler.step()

    # 3. At the boundary, once: the window loss, unscale, norm, clip, step.
    (loss,) = steps.sum_over_ranks(ddp, [objective_sum], device)
    loss /= world_size  # the objective whose gradient DDP averaged: sum / N for the reference
    if amp is not None:
        amp.unscale_(optimizer)
    grad_norm = float(steps.global_norm(params).item())
    finite = math.isfinite(grad_norm) and math.isfinite(loss)
    clip_coef = 1.0
    # decision 3: variant.clip, clip the window (here) or each micro-batch (above)
    if max_grad_norm is not None and finite and variant.clip == "window":
        clip_coef = steps.clip_coef(grad_norm, max_grad_norm)
        steps.scale_grads(params, clip_coef)
    lr = float(optimizer.param_groups[0]["lr"])  # the LR this step uses
    if amp is not None:
        if finite:
            amp.step(optimizer)  # would also skip optimizer.step() on inf/NaN gradients
        amp.update()  # backs the scale off iff unscale_ found an inf/NaN
        skipped = not finite or amp.get_scale() < loss_scale
        loss_scale = float(amp.get_scale())  # the scale of the next window
    else:
        if finite:
            optimizer.step()
        skipped = not finite

    # 4. The counters advance only with a real update.
    progress.micro_step += k
    if skipped:
        progress.skip_count += 1
        return record(
            progress, window_items, loss, grad_norm, grad_norm, SkipReason.NONFINITE, lr, loss_scale
        )
    # decision 4: variant.scheduler, once per applied update (here) or per micro-batch (above)
    if variant.scheduler == "per_update" and scheduler is not None:
        scheduler.step()
    progress.update_id += 1
    progress.cumulative_items += window_items
    clipped = grad_norm * clip_coef
    return record(
        progress, window_items, loss, grad_norm, clipped, SkipReason.APPLIED, lr, loss_scale
    )


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
    return [
        train_update(model, window, optimizer, progress=progress, **update_kwargs)
        for window in windows_of(microbatches, k, drop_last=drop_last)
    ]
