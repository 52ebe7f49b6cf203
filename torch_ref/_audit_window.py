"""`torch_ref.audit.audit_window`: one update of your loop, its cells' gradients, the fit."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

import bigbatch
from torch_ref._audit_args import (
    Batch,
    _check_batch,
    _check_callable,
    _check_model,
    _check_window,
    _num_rows,
    _numpy,
    _rounding,
    _rows,
)
from torch_ref._audit_loop import WindowFn, _window_here, _window_on_ranks

LossFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, Any]]
# run(model, batch, layout) -> the parameters after your update, one array per parameter
Runner = Callable[[nn.Module, Batch, bigbatch.CellLayout], list[np.ndarray]]


def audit_window(
    window_fn: WindowFn,
    loss_fn: LossFn,
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    k: int = 4,
    world_size: int = 1,
    learning_rate: float = 1.0,
    short_window: bool = False,
    max_grad_norm: float | None = None,
    timeout_s: float = 300.0,
    progress: bool = True,
) -> bigbatch.AuditReport:
    """Recovers how your loop weighs the items of each micro-batch and rank of one update.

    The twin of ``jaxaccum.audit.audit_window``: your loop's parameter change
    ``delta`` is fitted as ``-delta / lr = sum_c w_c grad S_c + e`` over the cells
    (``S_c`` the reference summed loss of cell ``c``; the big batch has
    ``w_c = 1 / N``, ``N`` the window's items), in float64 over the cells with
    items (``bigbatch.audit_update``).

    Args:
      window_fn: your code for ONE optimizer update, ``window_fn(model,
        optimizer, microbatches) -> None``, in place. ``optimizer`` is
        ``torch.optim.SGD(model.parameters(), lr=learning_rate)``; your code must
        step it. ``microbatches`` is a list of ``k`` (``tail_microbatches(k)``
        with ``short_window``) dicts of tensors with a leading row axis: this
        rank's. With ``world_size > 1`` it runs on each of ``world_size`` gloo
        ranks (CPU, 127.0.0.1) with ``model`` wrapped in
        ``DistributedDataParallel``; it must then be picklable (a module-level
        function, or a ``functools.partial`` of one). It runs on a copy: ``model``
        is left as it was. It runs on a window of other items first (undone: a
        count kept from it shows in the report), then twice from the same
        parameters, the first time with ``bigbatch.LR_SCALE`` x the learning
        rate, where it must move that many times further (one step per window,
        no gradients kept from the run before); else a ``ValueError``.
      loss_fn: the reference loss, ``loss_fn(model, batch) -> (loss_sum,
        num_items)``: a SUM over the batch's items and their number (e.g.
        `torch_ref.causal_lm_loss_sum` of the model's logits). Both must add up
        over rows (a mean is refused).
      model: a ``torch.nn.Module`` with float parameters, without dropout (the
        update must be deterministic). The audited parameters are those with
        ``requires_grad``.
      batch: the rows to audit, a dict of tensors (or arrays) with a leading
        row axis. Give rows whose items differ: short and long ones, a few
        without any (all labels -100).
      k: the micro-batches per window your loop accumulates.
      world_size: the data-parallel ranks; rank ``r`` gets the cells of device
        ``r`` of ``bigbatch.layout_rows``.
      learning_rate: the SGD learning rate handed to your code.
      short_window: audit a short tail window of ``k // 2`` micro-batches,
        closed by your code as its epoch's last.
      max_grad_norm: the threshold your loop clips the window's gradient norm
        to (``clip_grad_norm_`` before ``optimizer.step()``), if it clips: the
        report says whether the update is clipped to it (``report.clip_kept``;
        ``passed`` needs it). A window clipped once is ``exact`` with
        ``report.clip_scale < 1`` and ``report.clipped_to`` with or without it.
      timeout_s: the bound of a multi-rank run, start-up included.
      progress: a progress bar (tqdm, on stderr) while the cells' gradients are
        computed.

    Memory: the model, your loop's run on a copy of it, then the update (``4 P``
    bytes for float32 parameters) and ``4 P`` per cell gradient held (``bigbatch.CELL_MEMORY``, at
    least one); ``docs/audit.md`` gives the time and memory per parameter and
    per cell.

    Returns:
      A ``bigbatch.AuditReport`` (the JAX audit's): ``verdict`` (``"exact"``, a
      name of ``bigbatch.BUG_NAMES`` (``torch_ref.buggy.VARIANTS``' names) or
      ``bigbatch.CLIP_FORMS``, or ``"unknown"``), ``weights`` per cell in units
      of ``1/N``, ``residual``, ``passed``, the clip (``clip_scale``,
      ``clipped_to``); ``print(report)`` shows the table.

    Example:
      >>> import torch, torch_ref
      >>> from torch_ref.audit import audit_window
      >>> _ = torch.manual_seed(0)
      >>> model = torch.nn.Sequential(  # input_ids [B, T] -> logits [B, T, V]
      ...     torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
      >>> ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
      >>> labels = ids.clone()
      >>> labels[0, 3:] = labels[1, 6:] = -100  # rows of 2, 5, 7 and 7 tokens
      >>> def loss_fn(model, batch):  # the reference: a SUM and its items
      ...     return torch_ref.causal_lm_loss_sum(model(batch["input_ids"]), batch["labels"])
      >>> def nanogpt(model, optimizer, microbatches):  # mean loss / grad_accum_steps
      ...     for mb in microbatches:
      ...         loss_sum, n = loss_fn(model, mb)
      ...         (loss_sum / n / len(microbatches)).backward()
      ...     optimizer.step()
      ...     optimizer.zero_grad(set_to_none=True)
      >>> batch = {"input_ids": ids, "labels": labels}
      >>> report = audit_window(nanogpt, loss_fn, model, batch, k=2, progress=False)
      >>> # cells of 7 and 14 tokens (N = 21): each weighs N / (k n_c) times 1/N
      >>> report.verdict, report.items.tolist(), report.weights.round(3).tolist()
      ('mean_of_means', [[7.0, 14.0]], [[1.5, 0.75]])
    """
    _check_window(k, world_size, learning_rate, short_window)
    bigbatch.check_max_grad_norm(max_grad_norm)
    _check_callable(window_fn, "window_fn")
    if world_size == 1:
        run = functools.partial(_window_here, window_fn, learning_rate, warm_up=True)
    else:
        run = functools.partial(_window_on_ranks, window_fn, learning_rate, timeout_s, warm_up=True)
    return _audit(
        run, loss_fn, model, batch, k=k, world_size=world_size, learning_rate=learning_rate,
        short_window=short_window, max_grad_norm=max_grad_norm, progress=progress,
    )  # fmt: skip


def _audit(
    run: Runner,
    loss_fn: LossFn,
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    k: int,
    world_size: int,
    learning_rate: float,
    short_window: bool,
    max_grad_norm: float | None,
    progress: bool,
) -> bigbatch.AuditReport:
    """Layout, your update (``run``), the cells' gradients streamed, ``bigbatch``'s fit."""
    _check_callable(loss_fn, "loss_fn")
    params = _check_model(model)
    batch = _check_batch(batch)
    layout = _layout(loss_fn, model, batch, k, world_size, short_window)
    update = bigbatch.parameter_change(run(model, batch, layout), _numpy(params))
    cell_grad = lambda r, m: _grad(loss_fn, model, params, _rows(batch, layout.rows[r, m]))
    products = bigbatch.cell_products(
        cell_grad, update, layout, learning_rate=float(learning_rate), progress=progress
    )
    return bigbatch.audit_update(
        products, layout, learning_rate=float(learning_rate), params_rounding=_rounding(params),
        max_grad_norm=max_grad_norm,
    )  # fmt: skip


def _layout(loss_fn, model, batch, k, world_size, short_window) -> bigbatch.CellLayout:
    """The rows' items (the reference loss of each row alone, checked to add up) in cells."""
    with torch.no_grad():
        rows = [_loss_values(loss_fn, model, _rows(batch, [i])) for i in range(_num_rows(batch))]
        whole = _loss_values(loss_fn, model, batch)
    row_losses, row_items = (np.array([float(r[j]) for r in rows]) for j in (0, 1))
    bigbatch.check_sums(float(whole[0]), float(whole[1]), row_losses, row_items)
    return bigbatch.audit_layout(
        row_items, batch, k=k, num_devices=world_size, short_window=short_window
    )


def _loss_values(loss_fn: LossFn, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, float]:
    """``loss_fn(model, batch)``, checked to be a scalar tensor and a scalar number."""
    out = loss_fn(model, batch)
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise ValueError(
            f"loss_fn: expected (loss_sum, num_items), got {type(out).__name__} {out!r}; with a"
            " mean loss, return the sum and the items it averages instead"
        )
    loss_sum, num_items = out
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0 or np.ndim(num_items) != 0:
        raise ValueError(
            "loss_fn: expected (loss_sum, num_items) as a scalar tensor and a scalar, got"
            f" {type(loss_sum).__name__} of shape {tuple(np.shape(loss_sum))} and"
            f" {type(num_items).__name__} of shape {tuple(np.shape(num_items))}"
        )
    return loss_sum, float(num_items)


def _grad(
    loss_fn: LossFn, model: nn.Module, params: list[nn.Parameter], cell: Batch
) -> list[np.ndarray]:
    """The gradient of the cell's summed reference loss, per parameter (0 where unused)."""
    loss_sum, _ = _loss_values(loss_fn, model, cell)
    if not loss_sum.requires_grad:  # no item, no graph: a zero gradient
        return [np.zeros(tuple(p.shape), np.float32) for p in params]
    grads = torch.autograd.grad(loss_sum, params, allow_unused=True)
    return _numpy(
        [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
    )
