"""`torch_ref.audit.audit_window`: one update of your loop, its cells' gradients, the fit."""

from __future__ import annotations

import copy
import functools
import io
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

import bigbatch
from torch_ref import ddp
from torch_ref._audit_args import (
    Batch,
    _check_batch,
    _check_callable,
    _check_model,
    _check_window,
    _flat,
    _num_rows,
    _parameters,
    _rounding,
    _rows,
)

WindowFn = Callable[[nn.Module, torch.optim.Optimizer, list[Batch]], None]
LossFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, Any]]
# run(model, batch, layout) -> the parameters after your update, flat float64 (`_flat`)
Runner = Callable[[nn.Module, Batch, bigbatch.Layout], np.ndarray]


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
    timeout_s: float = 300.0,
) -> bigbatch.AuditReport:
    """Recovers how your loop weighs the items of each micro-batch and rank of one update.

    .. math::

       -\\frac{\\delta}{lr} = \\sum_c w_c\\, \\nabla_\\theta S_c + e, \\qquad
       \\text{big batch: } w_c = \\frac{1}{N}

    where ``delta`` is the parameter change your loop makes from the window,
    ``S_c`` the reference summed loss of cell ``c`` and ``N`` the window's items;
    a float64 least-squares fit over the cells with items (``bigbatch.audit_update``).

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
        is left as it was.
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
      timeout_s: the bound of a multi-rank run, start-up included.

    Returns:
      A ``bigbatch.AuditReport`` (the JAX audit's): ``verdict`` (``"exact"``, a
      name of ``bigbatch.BUG_NAMES`` = ``torch_ref.buggy.VARIANTS``, or
      ``"unknown"``), ``weights`` per cell in units of ``1/N``, ``residual``,
      ``passed``; ``print(report)`` shows the table.

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
      >>> report = audit_window(nanogpt, loss_fn, model, {"input_ids": ids, "labels": labels}, k=2)
      >>> # cells of 7 and 14 tokens (N = 21): each weighs N / (k n_c) times 1/N
      >>> report.verdict, report.items.tolist(), report.weights.round(3).tolist()
      ('mean_of_means', [[7.0, 14.0]], [[1.5, 0.75]])
    """
    _check_window(k, world_size, learning_rate, short_window)
    _check_callable(window_fn, "window_fn")
    if world_size == 1:
        run = functools.partial(_window_here, window_fn, learning_rate)
    else:
        run = functools.partial(_window_on_ranks, window_fn, learning_rate, timeout_s)
    return _audit(run, loss_fn, model, batch, k, world_size, learning_rate, short_window)


def _audit(
    run: Runner,
    loss_fn: LossFn,
    model: nn.Module,
    batch: Mapping[str, Any],
    k: int,
    world_size: int,
    learning_rate: float,
    short_window: bool,
) -> bigbatch.AuditReport:
    """Layout, cell gradients, your update (``run``), then ``bigbatch``'s fit and report."""
    _check_callable(loss_fn, "loss_fn")
    params = _check_model(model)
    batch = _check_batch(batch)
    with torch.no_grad():
        rows = [_loss_values(loss_fn, model, _rows(batch, [i])) for i in range(_num_rows(batch))]
        whole = _loss_values(loss_fn, model, batch)
    row_losses, row_items = (np.array([float(r[j]) for r in rows]) for j in (0, 1))
    bigbatch.check_sums(float(whole[0]), float(whole[1]), row_losses, row_items)
    layout = bigbatch.layout_rows(row_items, k=k, num_devices=world_size, short_window=short_window)
    bigbatch.check_layout(layout)
    cell_grads = np.stack(  # [R, k_window, P]: autograd of each cell's summed loss
        [
            [_grad(loss_fn, model, params, _rows(batch, cell)) for cell in device]
            for device in layout.rows
        ]
    )
    big_batch_update = -learning_rate * cell_grads.sum(axis=(0, 1)) / layout.items.sum()
    rounding = _rounding(params) / max(float(np.linalg.norm(big_batch_update)), 1e-300)
    bigbatch.check_precision(rounding, learning_rate)
    update = run(model, batch, layout) - _flat(params)
    return bigbatch.audit_update(
        update,
        cell_grads,
        layout,
        learning_rate=float(learning_rate),
        big_batch_update=big_batch_update,
        rounding=rounding,
    )


# ---- running your loop --------------------------------------------------------------------------


def _microbatches(batch: Batch, layout: bigbatch.Layout, rank: int) -> list[Batch]:
    """Rank ``rank``'s micro-batches: the cells of device ``rank`` of the layout."""
    return [_rows(batch, cell) for cell in layout.rows[rank]]


def _step(window_fn: WindowFn, model: nn.Module, microbatches: list[Batch], lr: float) -> None:
    """Your loop for one update, with the SGD the audit hands over."""
    window_fn(model, torch.optim.SGD(model.parameters(), lr=lr), microbatches)


def _window_here(
    window_fn: WindowFn, lr: float, model: nn.Module, batch: Batch, layout: bigbatch.Layout
) -> np.ndarray:
    """One rank, in this process, on a copy of the model."""
    model = copy.deepcopy(model)
    _step(window_fn, model, _microbatches(batch, layout, 0), lr)
    return _flat(_parameters(model))


def _window_on_ranks(
    window_fn: WindowFn,
    lr: float,
    timeout_s: float,
    model: nn.Module,
    batch: Batch,
    layout: bigbatch.Layout,
) -> np.ndarray:
    """``layout.num_devices`` gloo ranks, each with its cells, the model under DDP."""
    per_rank = [_microbatches(batch, layout, r) for r in range(layout.num_devices)]
    results = _on_ranks(
        layout.num_devices, _rank_window, model, per_rank, window_fn, lr, timeout_s=timeout_s
    )
    return _same_on_every_rank(results, _flat(_parameters(model)), "window_fn")


def _rank_window(rank, world_size, model, per_rank, window_fn, lr) -> np.ndarray:
    """One rank of `_window_on_ranks`: DDP around its own copy of the model, its cells."""
    del world_size
    wrapped = nn.parallel.DistributedDataParallel(model)
    _step(window_fn, wrapped, per_rank[rank], lr)
    return _flat(_parameters(model))


def _on_ranks(world_size, fn, model, data, *args, timeout_s: float) -> list[Any]:
    """``fn(rank, world_size, model, data, *args)`` on gloo ranks (`ddp.run`), each on its own copy.

    ``model`` and ``data`` travel as ``torch.save`` bytes: as arguments,
    torch.multiprocessing would hand the ranks the tensors in SHARED memory, and
    every rank would step the same parameters.
    """
    buffer = io.BytesIO()
    torch.save((copy.deepcopy(model).cpu(), data), buffer)
    return ddp.run(world_size, _rank_main, fn, buffer.getvalue(), args, timeout_s=timeout_s)


def _rank_main(rank, world_size, fn, payload: bytes, args) -> Any:
    model, data = torch.load(io.BytesIO(payload), weights_only=False)
    return fn(rank, world_size, model, data, *args)


def _same_on_every_rank(results: list[np.ndarray], old: np.ndarray, what: str) -> np.ndarray:
    """Rank 0's parameters, after checking that every rank holds them (DDP keeps replicas equal)."""
    moved = max(float(np.linalg.norm(results[0] - old)), 1e-300)
    for rank, params in enumerate(results[1:], start=1):
        gap = float(np.linalg.norm(params - results[0])) / moved
        if not gap <= bigbatch.RESIDUAL_RTOL:
            raise ValueError(
                f"{what}: rank {rank}'s parameters differ from rank 0's after the update by"
                f" {gap:.1e} of it: the ranks did not apply one common update (a step outside"
                " DistributedDataParallel's all-reduce, e.g. no_sync() around every micro-batch?)"
            )
    return results[0]


# ---- the reference loss and its gradients -------------------------------------------------------


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


def _grad(loss_fn: LossFn, model: nn.Module, params: list[nn.Parameter], cell: Batch) -> np.ndarray:
    """The gradient of the cell's summed reference loss, flat float64 (0 where unused)."""
    loss_sum, _ = _loss_values(loss_fn, model, cell)
    if not loss_sum.requires_grad:  # no item, no graph: a zero gradient
        return np.zeros(sum(p.numel() for p in params))
    grads = torch.autograd.grad(loss_sum, params, allow_unused=True)
    return _flat(
        [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
    )
