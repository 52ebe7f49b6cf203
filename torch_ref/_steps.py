"""The pieces of `torch_ref.train_update` around its loop: the choices and the arithmetic.

The loop itself reads top to bottom in ``_train.py``; here are the choices it
makes at its decision points (`objective_scale`, `no_sync_scopes`,
`backward_clipped`, each reading one switch of a `torch_ref.buggy.Variant`), the
one all-reduce of a few scalars (`sum_over_ranks`), and the global norm and
clipping factor of ``torch.nn.utils.clip_grad_norm_`` (`global_norm`,
`clip_coef`, `scale_grads`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_ref._loss import UNITS
from torch_ref.buggy import Variant

Microbatch = dict[str, torch.Tensor]


def objective_scale(
    objective: str,
    *,
    world_size: int,
    window_items: float,
    rank_items: float,
    microbatch_items: int,
    k: float,
) -> float:
    """Decision 1: the factor c of the micro-batch's objective ``c * loss_sum``.

    ``global_sum`` (the reference): ``R / N``; DDP's average over R then gives
    ``sum / N``. The bugs' factors are in `torch_ref.buggy`; a factor whose
    divisor is 0 is 0 (that micro-batch or rank has no item).
    """
    multiplier, divisor = {
        "global_sum": (world_size, window_items),
        "global_sum_no_R": (1.0, window_items),
        "rank_mean": (1.0, rank_items),
        "microbatch_mean": (1.0, float(microbatch_items)),
        "mean_of_means": (1.0, microbatch_items * k),
    }[objective]
    return multiplier / divisor if divisor else 0.0


def no_sync_scopes(
    ddp: nn.parallel.DistributedDataParallel | None, no_sync: str, last: bool
) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """Decision 2: the (forward, backward) contexts of one micro-batch.

    The reference enters ``ddp.no_sync()`` before the forward of every micro-batch
    but the last (DDP decides at forward time whether the backward all-reduces);
    the backward runs inside it.
    """
    if ddp is None or last or no_sync == "never":
        return contextlib.nullcontext(), contextlib.nullcontext()
    if no_sync == "backward_only":
        return contextlib.nullcontext(), ddp.no_sync()
    return ddp.no_sync(), contextlib.nullcontext()


def backward_clipped(
    objective: torch.Tensor, params: Sequence[nn.Parameter], max_norm: float | None
) -> None:
    """Decision 3, per micro-batch: backward, clip THIS micro-batch's gradient, add it."""
    assert max_norm is not None  # checked by check_arguments
    accumulated = [p.grad for p in params]
    for p in params:
        p.grad = None
    objective.backward()
    scale_grads(params, clip_coef(float(global_norm(params).item()), max_norm))
    with torch.no_grad():
        for p, acc in zip(params, accumulated, strict=True):
            if p.grad is None:
                p.grad = acc
            elif acc is not None:
                p.grad.add_(acc)


def check_arguments(
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
    if variant.tail_divisor == "nominal_k" and not nominal_k:
        raise ValueError(f"nominal_k: variant {variant.name!r} needs the configured k (>= 1)")
    if variant.clip == "per_microbatch" and (max_grad_norm is None or scaler is not None):
        raise ValueError(f"variant {variant.name!r} needs max_grad_norm and no scaler")
    if len(microbatches) == 0:
        raise ValueError("microbatches: expected at least one micro-batch in the window")


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on the model's device type for ``dtype`` (None: no autocast)."""
    return torch.autocast(device.type, dtype) if dtype is not None else contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def sum_over_ranks(
    ddp: nn.parallel.DistributedDataParallel | None, values: list[Any], device: torch.device
) -> list[float]:
    """``values`` (floats or scalar tensors) summed over the ranks, one all-reduce, float64."""
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    if ddp is not None:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=ddp.process_group)
    return [float(x) for x in stacked.tolist()]


def global_norm(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """``sqrt(sum_p ||g_p||^2)`` over all gradients, in float32 (float64 for float64)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    wide = [g.to(torch.promote_types(g.dtype, torch.float32)) for g in grads]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in wide]))


def clip_coef(norm: float, max_norm: float) -> float:
    """``min(1, max_norm / (norm + 1e-6))``: ``torch.nn.utils.clip_grad_norm_``'s factor."""
    return min(1.0, max_norm / (norm + 1e-6))


@torch.no_grad()
def scale_grads(params: Sequence[nn.Parameter], coef: float) -> None:
    """``g <- coef * g`` for every gradient (nothing to do for ``coef == 1``)."""
    if coef != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
