"""The pieces of `torch_ref.train_update` around its loop: placement, collectives, arithmetic.

The loop itself reads top to bottom in ``_train.py``, and the choices at its
decision points are the hooks of `torch_ref.buggy.Variant`. Here is what they
share: where the model runs (`placement`), the micro-batch's
forward and summed loss (`forward_loss_sum`), the one all-reduce of a few
scalars (`sum_over_ranks`, `window_items`), the global norm and clipping factor
of ``torch.nn.utils.clip_grad_norm_`` (`global_norm`, `unscaled_norm`, `clip_coef`,
`scale_grads`), a micro-batch's gradient on its own (`own_gradient`:
`backward_clipped`, `backward_if_finite`) and the GradScaler-aware step
(`optimizer_step`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from torch_ref._loss import causal_lm_loss_sum

Microbatch = dict[str, torch.Tensor]


@contextlib.contextmanager
def own_gradient(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """Inside: ``p.grad`` holds only what the block's backward adds (one micro-batch's
    gradient); after: the sums of the micro-batches before are added back to it."""
    accumulated = [p.grad for p in params]
    for p in params:
        p.grad = None
    yield
    with torch.no_grad():
        for p, acc in zip(params, accumulated, strict=True):
            if p.grad is None:
                p.grad = acc
            elif acc is not None:
                p.grad.add_(acc)


def backward_clipped(
    objective: torch.Tensor, params: Sequence[nn.Parameter], max_norm: float | None
) -> None:
    """Decision 3, per micro-batch: backward, clip THIS micro-batch's gradient, add it."""
    assert max_norm is not None  # checked by Variant.check
    with own_gradient(params):
        objective.backward()
        scale_grads(params, clip_coef(float(global_norm(params).item()), max_norm))


def backward_if_finite(objective: torch.Tensor, params: Sequence[nn.Parameter]) -> bool:
    """Decision 3, per micro-batch: backward; add THIS micro-batch's gradient if its norm
    is finite, else zeros in its place. Returns whether it was added."""
    with own_gradient(params):
        objective.backward()
        finite = math.isfinite(float(global_norm(params).item()))
        if not finite:
            for p in params:
                if p.grad is not None:
                    p.grad.zero_()
    return finite


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on the model's device type for ``dtype`` (None: no autocast)."""
    return torch.autocast(device.type, dtype) if dtype is not None else contextlib.nullcontext()


class Placement(NamedTuple):
    """Where the model runs.

    Attributes:
      ddp: its DistributedDataParallel wrapper, or None for a plain module.
      world_size: R, the ranks of its process group (1 without DDP).
      params: the parameters that take a gradient (those inside the wrapper).
      device: their device, where the micro-batches go.
    """

    ddp: nn.parallel.DistributedDataParallel | None
    world_size: int
    params: list[nn.Parameter]
    device: torch.device


def placement(model: nn.Module) -> Placement:
    """The `Placement` of a plain module or a DistributedDataParallel one."""
    ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
    world_size = dist.get_world_size(ddp.process_group) if ddp is not None else 1
    module = ddp.module if ddp is not None else model
    params = [p for p in module.parameters() if p.requires_grad]
    return Placement(ddp, world_size, params, params[0].device)


def forward_loss_sum(
    model: nn.Module, microbatch: Microbatch, unit: str, autocast_dtype: torch.dtype | None
) -> torch.Tensor:
    """The micro-batch's summed loss: the forward under `autocast`, the loss in float32."""
    with autocast(microbatch["input_ids"].device, autocast_dtype):
        logits = model(microbatch["input_ids"])
    loss_sum, _ = causal_lm_loss_sum(logits, microbatch["labels"], unit)
    return loss_sum


def sum_over_ranks(
    ddp: nn.parallel.DistributedDataParallel | None, values: list[Any], device: torch.device
) -> list[float]:
    """``values`` (floats or scalar tensors) summed over the ranks, one all-reduce, float64."""
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    if ddp is not None:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=ddp.process_group)
    return [float(x) for x in stacked.tolist()]


def window_items(
    ddp: nn.parallel.DistributedDataParallel | None,
    world_size: int,
    microbatch_items: Sequence[int],
    device: torch.device,
) -> float:
    """N: this rank's items summed over the ranks (one all-reduce, with the micro-batch count
    and its square: the counts are all equal iff both sums are ``world_size`` times this
    rank's). An empty ``microbatch_items`` is a rank whose micro-batches ran out (`train`).

    Raises:
      ValueError: the ranks pass different numbers of micro-batches.
    """
    k = len(microbatch_items)
    counts = [float(sum(microbatch_items)), float(k), float(k * k)]
    items, ranks_k, ranks_k2 = sum_over_ranks(ddp, counts, device)
    if ranks_k != k * world_size or ranks_k2 != k * k * world_size:
        ran_out = " (its micro-batches ran out)" if k == 0 else ""
        raise ValueError(
            f"microbatches: every rank must pass the same number of micro-batches; this rank"
            f" has {k}{ran_out}, the {world_size} ranks' counts differ (they total"
            f" {int(ranks_k)})"
        )
    return items


def global_norm(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """``sqrt(sum_p ||g_p||^2)`` over all gradients, in float32 (float64 for float64)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    wide = [g.to(torch.promote_types(g.dtype, torch.float32)) for g in grads]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in wide]))


def unscaled_norm(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, params: Sequence
) -> float:
    """At the boundary: the window gradient unscaled once (``scaler.unscale_``, with a
    GradScaler), and its `global_norm`."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    return float(global_norm(params).item())


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


def optimizer_step(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, finite: bool
) -> tuple[bool, float]:
    """Steps once if the window is finite: (skipped, the loss scale of the NEXT window).

    With a GradScaler: ``scaler.step`` (which would also skip on inf/NaN gradients),
    then ``scaler.update``, which backs the scale off iff ``unscale_`` found an
    inf/NaN; a backed-off window counts as skipped. Without one the scale is 1.0.
    """
    if scaler is None:
        if finite:
            optimizer.step()
        return not finite, 1.0
    scale = scaler.get_scale()
    if finite:
        scaler.step(optimizer)
    scaler.update()
    return not finite or scaler.get_scale() < scale, float(scaler.get_scale())
