"""`jaxaccum.audit.audit_invariance`: is your JAX loop's update the same for every cut?"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import bigbatch
from jaxaccum._audit_loop import _update as _update_on
from jaxaccum._audit_window import (
    LossFn,
    WindowFn,
    _cell_grad,
    _check_params,
    _num_rows,
    _row_values,
)

DEFAULT_CUTS = ((2, 1), (4, 1), (2, 2), (4, 2))
"""``(k, R)``: micro-batches per device, devices."""


def audit_invariance(
    window_fn: WindowFn,
    params: Any,
    batch: Any,
    *,
    cuts: Sequence[tuple[int, int]] = DEFAULT_CUTS,
    loss_fn: LossFn | None = None,
    row_items: Sequence[float] | None = None,
    learning_rate: float = 1.0,
    max_grad_norm: float | None = None,
    progress: bool = True,
) -> bigbatch.InvarianceReport:
    """Runs your loop for one SGD update on the same rows, cut several ways, and compares.

    .. math::

       \\mathrm{difference} = \\frac{|\\delta_{k,R} - \\delta_{1,1}|}{|\\delta_{1,1}|}

    The one-batch run (``k = 1``, one device) is the reference, whatever your
    objective is: a loop is invariant when every cut gives its update
    (``bigbatch.INVARIANCE_RTOL``). Invariant is not the big batch: a factor that is
    the same on every cut (a loop that never divides, a count kept from an earlier
    window) passes here, and :func:`audit_window` judges it. Each cut lays the rows out as
    :func:`audit_window` does (``bigbatch.layout_rows``).

    Args:
      window_fn: your code for ONE optimizer update, as in :func:`audit_window`:
        ``window_fn(params, microbatches, optimizer) -> new_params``, each
        micro-batch global over the cut's ``R`` devices (device ``r`` owns the
        ``r``-th contiguous slice of its rows). With a cut of ``R > 1`` it must
        take a keyword ``num_devices`` too, and gets the cut's ``R`` there (the
        one-batch run: 1).
      params: the parameters (a pytree of float arrays).
      batch: the rows, a pytree with a leading row axis; their number must be a
        multiple of ``k R`` for every cut.
      cuts: ``(k, R)`` pairs: micro-batches per device and devices.
      loss_fn: optional ``loss_fn(params, batch) -> (loss_sum, num_items)``, a sum
        over rows: the rows' items, and their gradients for the weights.
      row_items: the items of each row, when there is no ``loss_fn`` (default:
        ``batch["labels"][:, 1:] != -100`` per row, else one per row; labels with
        another negative value are refused).
      learning_rate: the SGD learning rate handed to your code (finite, > 0);
        each cut runs twice, at ``bigbatch.LR_SCALE`` x it first, and a loop
        whose update is not proportional to it (a step per micro-batch) is
        refused.
      max_grad_norm: the threshold your loop clips the window's gradient norm
        to, if it clips: the report says whether the one-batch run clipped (its
        reference is then the whole batch's gradient clipped to it; a loop that
        clips its window once gives that on every cut, one that clips each
        micro-batch does not).
      progress: a progress bar while the rows' gradients are computed.

    Returns:
      A ``bigbatch.InvarianceReport`` (``invariant``, ``worst``, ``breaking``,
      ``differences``, and with ``loss_fn`` the rows' ``weights`` relative to
      the one-batch run); ``print(report)`` shows the table.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxaccum
      >>> x = np.linspace(-1.0, 1.0, 8, dtype=np.float32)  # 8 rows of 0 to 7 items
      >>> batch = {"x": x, "items": np.arange(8, dtype=np.float32)}
      >>> def loss_fn(w, batch):  # a SUM: each row's items times (w - x)^2, and the items
      ...     return jnp.sum(batch["items"] * (w - batch["x"]) ** 2), jnp.sum(batch["items"])
      >>> def jaxaccum_window(w, microbatches, optimizer):  # sums, divided once
      ...     tx = jaxaccum.multi_steps(optimizer, len(microbatches))
      ...     state = tx.init(w)
      ...     for mb in microbatches:
      ...         (_, n), grad = jaxaccum.value_and_grad(loss_fn)(w, mb)
      ...         updates, state = tx.update(grad, state, w, num_items=n)
      ...         w = optax.apply_updates(w, updates)
      ...     return w
      >>> report = jaxaccum.audit.audit_invariance(
      ...     jaxaccum_window, jnp.float32(0.5), batch, cuts=[(2, 1), (4, 1)], progress=False,
      ...     row_items=batch["items"])
      >>> report.invariant, report.worst < 1e-5
      (True, True)
    """
    _check_params(params)
    bigbatch.check_max_grad_norm(max_grad_norm)
    bigbatch.check_learning_rate(learning_rate)
    batch = jax.tree.map(lambda x: x if hasattr(x, "shape") else np.asarray(x), batch)
    rows = _num_rows(batch)
    if loss_fn is not None:
        bigbatch.refuse_row_items_with_loss_fn(row_items)
        row_items = np.asarray(_row_values(loss_fn, params, batch)[1])
    items = bigbatch.row_items_of(batch, row_items, rows)
    layouts = [
        bigbatch.layout_rows(items, k=k, num_devices=ranks)
        for k, ranks in bigbatch.check_cuts(cuts, rows)
    ]
    devices = _takes_devices(window_fn, layouts)

    def run(layout):  # the loop on the cut's rows (and told its device count, if it must be)
        kwargs = {"num_devices": layout.num_devices} if devices else {}
        # twice per cut, at LR_SCALE x the rate first: a loop that steps per micro-batch moves
        # with the cut by about lr x curvature, which a small rate hides below the tolerance
        return _update_on(window_fn, params, batch, layout, learning_rate, warm_up=False, **kwargs)

    one_batch = run(bigbatch.layout_rows(items, k=1, num_devices=1))
    updates = [run(layout) for layout in layouts]
    row_grad = None
    if loss_fn is not None:
        row_grad = lambda i: _cell_grad(
            loss_fn, params, jax.tree.map(lambda x: x[i : i + 1], batch)
        )
    names = [f"k={layout.k} x R={layout.num_devices}" for layout in layouts]
    return bigbatch.invariance_report(
        names,
        one_batch,
        updates,
        row_items=items,
        row_grad=row_grad,
        progress=progress,
        learning_rate=float(learning_rate),
        max_grad_norm=max_grad_norm,
    )


def _takes_devices(window_fn: WindowFn, layouts: list[bigbatch.CellLayout]) -> bool:
    """Whether ``window_fn`` is told each cut's device count: where a cut has more than one
    (then it must take ``num_devices``)."""
    if all(layout.num_devices == 1 for layout in layouts):
        return False
    parameters = inspect.signature(window_fn).parameters.values()
    if not any(p.name == "num_devices" or p.kind is p.VAR_KEYWORD for p in parameters):
        raise ValueError(
            "window_fn: a cut of more than one device tells your code its device count:"
            " expected window_fn(params, microbatches, optimizer, *, num_devices)"
        )
    return True
