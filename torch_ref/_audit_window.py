"""`torch_ref.audit.audit_window`: one update of your loop, its cells' gradients, the fit."""

from __future__ import annotations

import copy
import functools
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

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
    _num_rows,
    _numpy,
    _parameters,
    _rounding,
    _rows,
)

WindowFn = Callable[[nn.Module, torch.optim.Optimizer, list[Batch]], None]
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
      progress: a progress bar (tqdm, on stderr) while the cells' gradients are
        computed.

    Memory: the model, your loop's run on a copy of it, then ``8 P`` bytes for
    the update and ``4 P`` per cell gradient held (``bigbatch.CELL_MEMORY``, at
    least one); ``docs/audit.md`` gives the time and memory per parameter and
    per cell.

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
      >>> batch = {"input_ids": ids, "labels": labels}
      >>> report = audit_window(nanogpt, loss_fn, model, batch, k=2, progress=False)
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
    return _audit(
        run, loss_fn, model, batch, k=k, world_size=world_size, learning_rate=learning_rate,
        short_window=short_window, progress=progress,
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
        products, layout, learning_rate=float(learning_rate), params_rounding=_rounding(params)
    )


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


# ---- running your loop --------------------------------------------------------------------------


def _microbatches(batch: Batch, layout: bigbatch.CellLayout, rank: int) -> list[Batch]:
    """Rank ``rank``'s micro-batches: the cells of device ``rank`` of the layout."""
    return [_rows(batch, cell) for cell in layout.rows[rank]]


def _step(window_fn: WindowFn, model: nn.Module, microbatches: list[Batch], lr: float) -> None:
    """Your loop for one update, with the SGD the audit hands over."""
    window_fn(model, torch.optim.SGD(model.parameters(), lr=lr), microbatches)


def _window_here(
    window_fn: WindowFn, lr: float, model: nn.Module, batch: Batch, layout: bigbatch.CellLayout
) -> list[np.ndarray]:
    """One rank, in this process, on a copy of the model; the parameters after the update."""
    model = copy.deepcopy(model)
    _step(window_fn, model, _microbatches(batch, layout, 0), lr)
    model.zero_grad(set_to_none=True)  # the copy's gradients: freed before the audit goes on
    return _numpy(_parameters(model))


def _window_on_ranks(
    window_fn: WindowFn,
    lr: float,
    timeout_s: float,
    model: nn.Module,
    batch: Batch,
    layout: bigbatch.CellLayout,
) -> list[np.ndarray]:
    """``layout.num_devices`` gloo ranks, each with its cells, the model under DDP."""
    per_rank = [_microbatches(batch, layout, r) for r in range(layout.num_devices)]
    results = _on_ranks(
        layout.num_devices, _rank_window, model, per_rank, window_fn, lr, timeout_s=timeout_s
    )
    return _same_on_every_rank(results, _parameters(model), "window_fn")


def _rank_window(rank, world_size, model, per_rank, window_fn, lr) -> RankParameters:
    """One rank of `_window_on_ranks`: DDP around its own copy of the model, its cells."""
    del world_size
    wrapped = nn.parallel.DistributedDataParallel(model)
    _step(window_fn, wrapped, per_rank[rank], lr)
    return _rank0_parameters(rank, model)


def _on_ranks(
    world_size, fn, model, data, *args, timeout_s: float, environ: Mapping[str, str] | None = None
) -> list[Any]:
    """``fn(rank, world_size, model, data, *args)`` on gloo ranks (`ddp.run`), each on its own copy.

    ``model`` and ``data`` travel in a ``torch.save`` file: as arguments,
    torch.multiprocessing would hand the ranks the tensors in SHARED memory, and
    every rank would step the same parameters. ``environ``: variables each rank
    sets before it loads them (the ranks fork from a server started earlier, with
    the environment of that moment; loading a model may import what reads them).
    """
    with tempfile.TemporaryDirectory(prefix="torch_ref_audit_") as folder:
        payload = os.path.join(folder, "model_and_data.pt")
        on_cpu = all(p.device.type == "cpu" for p in model.parameters())
        torch.save((model if on_cpu else copy.deepcopy(model).cpu(), data), payload)
        environ = dict(environ or {})
        return ddp.run(world_size, _rank_main, fn, payload, args, environ, timeout_s=timeout_s)


def _rank_main(rank, world_size, fn, payload: str, args, environ: dict[str, str]) -> Any:
    os.environ.update(environ)
    model, data = torch.load(payload, weights_only=False)
    return fn(rank, world_size, model, data, *args)


class RankParameters(NamedTuple):
    """A rank's answer: rank 0's parameters after the update (None on the other ranks), and
    the squared distance of this rank's parameters to them."""

    params: list[np.ndarray] | None
    distance_sq: float


def _rank0_parameters(rank: int, model: nn.Module) -> RankParameters:
    """Inside a rank: rank 0's parameters, and how far this rank's are from them (a broadcast
    per parameter; only rank 0 sends its parameters back)."""
    distance_sq = 0.0
    for p in _parameters(model) if torch.distributed.is_initialized() else ():
        theirs = p.detach().clone()
        torch.distributed.broadcast(theirs, src=0)
        distance_sq += float((p.detach() - theirs).double().square().sum())
    return RankParameters(_numpy(_parameters(model)) if rank == 0 else None, distance_sq)


def _same_on_every_rank(
    results: list[RankParameters], old: list[nn.Parameter], what: str
) -> list[np.ndarray]:
    """Rank 0's parameters, after checking that every rank holds them (DDP keeps replicas equal)."""
    new = results[0].params
    moved_sq = sum(
        float(np.sum(np.square(n.astype(np.float64) - p.detach().double().numpy())))
        for n, p in zip(new, old, strict=True)
    )
    for rank, result in enumerate(results[1:], start=1):
        gap = (result.distance_sq / max(moved_sq, 1e-300)) ** 0.5
        if not gap <= bigbatch.RESIDUAL_RTOL:
            raise ValueError(
                f"{what}: rank {rank}'s parameters differ from rank 0's after the update by"
                f" {gap:.1e} of it: the ranks did not apply one common update (a step outside"
                " DistributedDataParallel's all-reduce, e.g. no_sync() around every micro-batch?)"
            )
    return new


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
