"""`torch_ref.audit.audit_invariance`: is your loop's update the same for every cut of its window?"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
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
    _numpy,
    _rows,
)
from torch_ref._audit_loop import WindowFn, _window_here, _window_on_ranks
from torch_ref._audit_window import LossFn, _grad, _loss_values

DEFAULT_CUTS = ((2, 1), (4, 1), (2, 2), (4, 2))
"""``(k, R)``: micro-batches per rank, ranks."""


def audit_invariance(
    window_fn: WindowFn,
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    cuts: Sequence[tuple[int, int]] = DEFAULT_CUTS,
    loss_fn: LossFn | None = None,
    row_items: Sequence[float] | None = None,
    learning_rate: float = 1.0,
    max_grad_norm: float | None = None,
    timeout_s: float = 300.0,
    progress: bool = True,
) -> bigbatch.InvarianceReport:
    """Runs your loop for one SGD update on the same rows, cut several ways, and compares.

    .. math::

       \\mathrm{difference} = \\frac{|\\delta_{k,R} - \\delta_{1,1}|}{|\\delta_{1,1}|}

    The one-batch run (``k = 1``, ``R = 1``) is the reference, whatever your
    objective is: a loop is invariant when every cut gives its update
    (``bigbatch.INVARIANCE_RTOL``). Invariant is not the big batch: a factor that is
    the same on every cut (a loop that never divides, a count kept from an earlier
    window) passes here, and `audit_window` judges it. Each cut lays the rows out as the audit does
    (``bigbatch.layout_rows``: the micro-batches differ in items, and with
    enough rows without items the last rank gets none).

    Args:
      window_fn: your code for ONE optimizer update, as in `audit_window`:
        ``window_fn(model, optimizer, microbatches) -> None`` (on gloo ranks
        under ``DistributedDataParallel`` when ``R > 1``: picklable then).
      model: a ``torch.nn.Module`` without dropout; left as it was.
      batch: the rows, a dict of tensors with a leading row axis; their number
        must be a multiple of ``k R`` for every cut (every cut uses every row).
      cuts: ``(k, R)`` pairs: micro-batches per rank and ranks.
      loss_fn: optional ``loss_fn(model, batch) -> (loss_sum, num_items)``, a
        sum over rows: the rows' items, and their gradients for the weights.
      row_items: the items of each row, when there is no ``loss_fn`` (default:
        counted from ``batch["labels"]`` by `bigbatch.row_items_of`, else one
        per row).
      learning_rate: the SGD learning rate handed to your code, finite and > 0
        (every cut's loop is first run at ``bigbatch.LR_SCALE`` times it, as
        `audit_window` runs its loop).
      max_grad_norm: the threshold your loop clips the window's gradient norm
        to, if it clips: the report says whether the one-batch run clipped (the
        reference is then the whole batch's gradient clipped to it; a loop that
        clips its window once gives that on every cut, one that clips each
        micro-batch does not).
      timeout_s: the bound of each multi-rank run.
      progress: a progress bar while the rows' gradients are computed.

    Returns:
      A ``bigbatch.InvarianceReport``: ``invariant``, ``worst``, ``breaking``,
      per-cut ``differences`` and (with ``loss_fn``) the rows' ``weights``
      relative to the one-batch run; ``print(report)`` shows the table.

    Example (``torch_ref/_audit_invariance_test.py`` runs it)::

      report = audit_invariance(nanogpt, model, batch, loss_fn=loss_fn)
      report.invariant, report.breaking   # -> (False, 'k=4 x R=2')
    """
    _check_callable(window_fn, "window_fn")
    bigbatch.check_max_grad_norm(max_grad_norm)
    bigbatch.check_learning_rate(learning_rate)
    params = _check_model(model)
    batch = _check_batch(batch)
    items = _items(loss_fn, model, batch, row_items)
    layouts = [
        bigbatch.layout_rows(items, k=k, num_devices=ranks)
        for k, ranks in bigbatch.check_cuts(cuts, items.size)
    ]
    run = functools.partial(_update, window_fn, learning_rate, timeout_s, model, batch, params)
    one_batch = run(bigbatch.layout_rows(items, k=1, num_devices=1))
    updates = [run(layout) for layout in layouts]
    row_grad = None
    if loss_fn is not None:
        row_grad = lambda i: _grad(loss_fn, model, params, _rows(batch, [i]))
    names = [f"k={layout.k} x R={layout.num_devices}" for layout in layouts]
    return bigbatch.invariance_report(
        names, one_batch, updates, row_items=items, row_grad=row_grad, progress=progress,
        learning_rate=float(learning_rate), max_grad_norm=max_grad_norm,
    )  # fmt: skip


def _update(window_fn, lr, timeout_s, model, batch, params, layout) -> list[np.ndarray]:
    """Your loop's parameter change ``new - old`` on ``layout``, float64, leaf by leaf."""
    if layout.num_devices == 1:
        new = _window_here(window_fn, lr, model, batch, layout)
    else:
        new = _window_on_ranks(window_fn, lr, timeout_s, model, batch, layout)
    return bigbatch.parameter_change(new, _numpy(params))


def _items(loss_fn, model, batch: Batch, row_items) -> np.ndarray:
    """The items of each row: ``loss_fn``'s, else ``bigbatch.row_items_of``'s."""
    rows = next(iter(batch.values())).shape[0]
    if loss_fn is not None:
        _check_callable(loss_fn, "loss_fn")
        bigbatch.refuse_row_items_with_loss_fn(row_items)
        with torch.no_grad():
            row_items = [_loss_values(loss_fn, model, _rows(batch, [i]))[1] for i in range(rows)]
    labels = {"labels": batch["labels"].cpu().numpy()} if "labels" in batch else {}
    return bigbatch.row_items_of(labels, row_items, rows)
