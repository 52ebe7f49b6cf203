"""From a loop's update to the weights it gives each cell, and the verdict.

With plain SGD the update of one window is ``delta = -lr * g``. Every known
accumulation bug computes ``g`` as a reweighting of the gradients ``G_c`` of
the cells' summed losses (``_forms.py``)::

    -delta / lr = sum_c w_c G_c + e

so the weights are a least-squares fit (float64) over the cells that hold
items, computed from the cells' inner products (``_products.py``: memory of
the parameters' size, whatever the number of cells), and the residual
``|e| / |delta / lr|`` says whether the loop is a reweighting at all. The
weights are then compared with each known form.

Tolerances (relative), and why:

* ``RESIDUAL_RTOL = 1e-3``: float32 gradients and the float32 update read
  back as ``new - old`` put a reweighting's residual at ~1e-6; a loop that is
  no reweighting (Adam's first step is nearly ``sign(g)``, an elementwise
  clip) leaves residuals of percents or more.
* ``WEIGHT_RTOL = 1e-3``: the recovered weights of a float32 loop are within
  ~1e-6 of their formula, times the fit's amplification (the condition number
  of the cells' gradients, at most ``MAX_CONDITION``; 2 to 4 on the tests'
  tiny models).
* ``SEPARATION = 0.05``: the audit refuses a batch whose layout does not make
  every checkable bug differ from the big batch by at least 5% in some cell,
  50x the weight tolerance, so that no bug can pass for the big batch. (Bugs
  that weigh the window alike are all listed in ``matches``.)
* ``MAX_CONDITION = 1e4``: beyond it float32 noise (~1e-7) could move the
  weights by ~1e-3, the tolerance.
* ``MAX_ROUNDING = 1e-4``: the update is read back in the parameters' dtype;
  its rounding must stay 10x below the residual tolerance.
* ``ITEMS_RTOL = 1e-6``, ``LOSS_RTOL = 1e-4``: the reference loss of a batch
  against the sum over its rows (``check_sums``): the items are counts (exact
  in float32 up to 2**24), the float32 loss sums add the same numbers in
  another order (~1e-6); a mean instead of a sum is off by ~1.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from bigbatch._forms import (
    COUNT_FORMS,
    EXACT,
    FIXED_DIVISOR_TAIL,
    checkable_forms,
    form_weights,
)
from bigbatch._layout import CellLayout, first_labels_of, layout_rows
from bigbatch._products import CellProducts
from bigbatch._report import UNKNOWN, AuditReport

RESIDUAL_RTOL = 1e-3
WEIGHT_RTOL = 1e-3
SEPARATION = 0.05
MAX_CONDITION = 1e4
MAX_ROUNDING = 1e-4
ITEMS_RTOL = 1e-6
LOSS_RTOL = 1e-4


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def check_window(*, k: object, num_devices: object, learning_rate: object, short_window: object):
    """Checks the window arguments of an audit; raises a ``ValueError`` naming the bad one.

    Example:
      >>> check_window(k=4, num_devices=1, learning_rate=0.0, short_window=False)
      Traceback (most recent call last):
      ...
      ValueError: learning_rate: expected a finite number > 0, got 0.0
    """
    k = _positive_int(k, "k")
    num_devices = _positive_int(num_devices, "num_devices")
    if (
        isinstance(learning_rate, bool)
        or not isinstance(learning_rate, numbers.Real)
        or not np.isfinite(learning_rate)
        or learning_rate <= 0
    ):
        raise ValueError(f"learning_rate: expected a finite number > 0, got {learning_rate!r}")
    if not isinstance(short_window, bool | np.bool_):
        raise ValueError(f"short_window: expected a bool, got {short_window!r}")
    if short_window and k < 2:
        raise ValueError(f"short_window: a short window needs k >= 2 micro-batches, got k={k}")
    if not short_window and k * num_devices < 2:
        raise ValueError(
            f"k: a window of k={k} micro-batch on num_devices={num_devices} device is one cell:"
            " every known bug weighs it like the big batch, so there is nothing to audit;"
            " use k >= 2 or num_devices >= 2"
        )


def check_layout(layout: CellLayout) -> tuple[str, ...]:
    """The forms the layout can tell apart; raises when its cells are too alike.

    Every bug that some window of this shape separates from the big batch must
    differ from it by at least ``SEPARATION`` (relative) in some cell of this
    one; otherwise the rows do not differ enough in items.

    Returns:
      The forms to check, in the order a verdict prefers them: ``"exact"``
      first, then (in a short window) ``"fixed_divisor_tail"``, then the others
      in ``FORM_NAMES`` order, then, when the rows' labels are known and some
      set position 0, the :data:`COUNT_FORMS` (a uniform scale that may be close
      to 1: not held to ``SEPARATION``; within ``WEIGHT_RTOL`` of the big batch
      both are listed).

    Example:
      >>> from bigbatch import layout_rows
      >>> check_layout(layout_rows(np.array([1.0, 3.0]), k=2, num_devices=1))
      ('exact', 'mean_of_means', 'missing_1_over_k')
    """
    items = layout.items
    if not np.any(items > 0):
        raise ValueError("batch: no row has an item (every label masked?): there is nothing to fit")
    forms = checkable_forms(layout.num_devices, layout.k_window, k=layout.k)
    if FIXED_DIVISOR_TAIL in forms:  # a short window is audited for its tail: that form first
        forms = (EXACT, FIXED_DIVISOR_TAIL, *(f for f in forms[1:] if f != FIXED_DIVISOR_TAIL))
    for name in forms[1:]:
        weights = form_weights(name, items, k=layout.k)
        separation = float(np.nanmax(np.abs(weights - 1.0)))
        if separation < SEPARATION:
            raise ValueError(
                f"batch: its rows are too alike in items to tell {name} from the big batch on this"
                f" window (the weights differ by {separation:.1%} at most, {SEPARATION:.0%} needed;"
                f" items per cell {items.tolist()}); pass rows whose items differ, e.g. mask the"
                " labels of some rows (-100) and shorten others"
            )
    if layout.first_labels is not None and np.sum(layout.first_labels) > 0:
        forms = (*forms, *COUNT_FORMS)
    return forms


def audit_layout(
    row_items: np.ndarray, batch: Any, *, k: int, num_devices: int, short_window: bool = False
) -> CellLayout:
    """The audit's cells for ``batch``'s rows: :func:`layout_rows`, with each row's label at
    position 0 read off ``batch`` (:func:`first_labels_of`), checked by :func:`check_layout`.

    Example:
      >>> audit_layout(np.array([1.0, 3.0]), {}, k=2, num_devices=1).items
      array([[1., 3.]])
    """
    layout = layout_rows(
        row_items,
        k=k,
        num_devices=num_devices,
        short_window=short_window,
        row_first_labels=first_labels_of(batch),
    )
    check_layout(layout)
    return layout


def check_precision(rounding: float, learning_rate: float) -> None:
    """Refuses an update too small to be read back in the parameters' dtype.

    Args:
      rounding: ``eps(dtype) * |params| / |big-batch update|``, relative.
      learning_rate: the SGD learning rate (the update is linear in it).

    Example:
      >>> check_precision(1e-6, 1.0)  # float32 parameters of ~0.5, an update of ~0.05
    """
    if not rounding <= MAX_ROUNDING:
        needed = learning_rate * rounding / MAX_ROUNDING
        raise ValueError(
            f"learning_rate: the big-batch update at learning_rate={learning_rate:g} is only"
            f" {1 / rounding:.3g}x the rounding of the parameters' dtype, too small to read"
            f" back; use learning_rate >= {needed:.3g} (SGD's update is linear in it)"
        )


def check_sums(
    loss_sum: float, num_items: float, row_losses: np.ndarray, row_items: np.ndarray
) -> None:
    """Refuses a reference loss that does not add up over rows (a mean, or a count per batch).

    .. math::

       |S(\\text{batch}) - \\textstyle\\sum_i S(\\text{row}_i)| \\le
       \\mathrm{rtol} \\textstyle\\sum_i |S(\\text{row}_i)|

    for the summed loss (``rtol = LOSS_RTOL``: the float32 sums add the same
    numbers in another order, ~1e-6) and its items (``ITEMS_RTOL``: counts,
    exact in float32 up to 2**24); relative to the rows' magnitudes, since an RL
    loss may add up to ~0 from both signs. A mean instead of a sum is off by ~1.

    Args:
      loss_sum: the reference loss of the whole batch.
      num_items: its items.
      row_losses: ``[B]`` the loss of each row alone.
      row_items: ``[B]`` the items of each row alone.

    Example:
      >>> check_sums(3.0, 2.0, np.array([1.0, 2.0]), np.array([1.0, 1.0]))  # a sum: fine
      >>> check_sums(1.5, 1.0, np.array([1.0, 2.0]), np.array([1.0, 1.0]))  # a mean
      Traceback (most recent call last):
      ...
      ValueError: loss_fn: expected a summed loss whose num_items adds up over rows; ...
    """
    row_losses = np.asarray(row_losses, np.float64)
    row_items = np.asarray(row_items, np.float64)
    if not (np.all(np.isfinite(row_items)) and np.all(row_items >= 0)):
        raise ValueError(
            f"loss_fn: expected a finite num_items >= 0 for every row, got {row_items.tolist()}"
        )
    if not np.all(np.isfinite(row_losses)):
        raise ValueError("loss_fn: the summed loss of some row is not finite (NaN or inf)")
    for what, whole, parts, rtol in (
        ("num_items", float(num_items), row_items, ITEMS_RTOL),
        ("loss_sum", float(loss_sum), row_losses, LOSS_RTOL),
    ):
        if not abs(whole - parts.sum()) <= rtol * max(np.abs(parts).sum(), 1e-30):
            raise ValueError(
                f"loss_fn: expected a summed loss whose {what} adds up over rows; the batch gives"
                f" {whole:.6g}, its rows {parts.sum():.6g} in all: return a sum and its items (e.g."
                " jaxaccum.losses.causal_lm, torch_ref.causal_lm_loss_sum), not a mean"
            )


def audit_update(
    products: CellProducts,
    layout: CellLayout,
    *,
    learning_rate: float,
    params_rounding: float = 0.0,
) -> AuditReport:
    """Fits the weights a loop gave each cell, and names the form they have.

    .. math::

       w = A^{-1} G^T t, \\qquad
       \\mathrm{residual} = \\frac{\\sqrt{|t|^2 - t^T G A^{-1} G^T t}}{|t|},
       \\qquad t = -\\delta / lr

    the least-squares weights of ``-delta / lr = G w + e`` over the cells with
    items, from the products of :func:`cell_products` (``A = G^T G``); the verdict is the first form of
    ``check_layout(layout)`` whose weights are within ``WEIGHT_RTOL`` of
    ``w N`` in every such cell, provided the residual is at most
    ``RESIDUAL_RTOL``, else ``"unknown"``.

    Args:
      products: the :class:`CellProducts` of the loop's update and the cells.
      layout: the :class:`bigbatch.CellLayout` the loop was fed.
      learning_rate: the SGD learning rate the loop was given.
      params_rounding: ``|eps(dtype) * params|``, the rounding of reading the
        update back as ``new - old`` (:func:`check_precision` refuses an update
        too small for it).

    Returns:
      An :class:`AuditReport`.

    Example:
      >>> import numpy as np
      >>> from bigbatch import cell_products, layout_rows
      >>> layout = layout_rows(np.array([3.0, 1.0]), k=2, num_devices=1)  # items [[1, 3]]
      >>> grads = {(0, 0): [np.array([1.0, 0.0])], (0, 1): [np.array([0.0, 3.0])]}
      >>> # a mean of means, lr 1: -(G_0 / (2 * 1) + G_1 / (2 * 3))
      >>> products = cell_products(lambda r, m: grads[r, m], [np.array([-0.5, -0.5])],
      ...                          layout, learning_rate=1.0, progress=False)
      >>> report = audit_update(products, layout, learning_rate=1.0)
      >>> report.verdict, report.weights.round(4).tolist()  # in units of 1/N = 1/4
      ('mean_of_means', [[2.0, 0.6667]])
    """
    forms = check_layout(layout)
    total = float(layout.items.sum())
    condition = _condition(products.gram)
    big_batch = math.sqrt(max(float(products.gram.sum()), 0.0)) / total  # |sum_c G_c| / N
    rounding = params_rounding / (learning_rate * big_batch) if big_batch > 0 else math.inf
    check_precision(rounding, learning_rate)
    weights, residual = _fit(products, layout.items)
    with np.errstate(invalid="ignore"):
        errors = {name: _form_error(weights, layout, name) for name in forms}
    is_reweighting = residual <= RESIDUAL_RTOL
    matches = tuple(name for name in forms if is_reweighting and errors[name] <= WEIGHT_RTOL)
    full = layout.items > 0
    weights.flags.writeable = False
    return AuditReport(
        verdict=matches[0] if matches else UNKNOWN,
        weights=weights,
        items=layout.items,
        residual=residual,
        scale=float(np.sum(layout.items[full] * weights[full]) / total),
        max_weight_error=errors[EXACT],
        update_error=_update_error(products, total, big_batch),
        form_errors=errors,
        matches=matches,
        k=layout.k,
        first_labels=layout.first_labels,
        condition=condition,
        residual_tolerance=RESIDUAL_RTOL,
        weight_tolerance=WEIGHT_RTOL,
        rounding=float(rounding),
        left_out_rows=int(layout.left_out.size),
    )


def _condition(gram: np.ndarray) -> float:
    """The condition number of the cells' gradients, ``sqrt`` of their Gram matrix's;
    refuses cells whose gradients cannot be told apart."""
    eigenvalues = np.linalg.eigvalsh(gram)
    condition = math.sqrt(eigenvalues[-1] / eigenvalues[0]) if eigenvalues[0] > 0 else math.inf
    if not condition <= MAX_CONDITION:
        raise ValueError(
            f"batch: the gradients of its {len(gram)} cells with items are (nearly) linearly"
            f" dependent (condition number {condition:.3g}, at most {MAX_CONDITION:g}): the weights"
            " cannot be told apart; use rows that differ, or a model with more parameters"
        )
    return condition


def _fit(products: CellProducts, items: np.ndarray) -> tuple[np.ndarray, float]:
    """The weights in units of ``1/N`` (NaN for cells without items) and the relative residual.

    A NaN or inf update has nothing to fit: NaN weights, an infinite residual. No
    update at all: zero weights, residual 0.
    """
    weights = np.full(items.shape, np.nan)
    cell = tuple(products.cells.T)
    if not math.isfinite(products.update_norm):
        return weights, math.inf
    if products.update_norm == 0:
        weights[cell] = 0.0
        return weights, 0.0
    total = float(items.sum())
    # w - 1/N from the deviation's products G^T d = G^T t - A 1/N: the fit's shift from the
    # big batch, exact where the loop is (no cancellation against 1/N)
    shift = np.linalg.solve(products.gram, _deviation(products, total))
    weights[cell] = 1.0 + total * shift
    unexplained = products.update_norm**2 - float(products.to_update @ (shift + 1.0 / total))
    return weights, math.sqrt(max(unexplained, 0.0)) / products.update_norm


def _deviation(products: CellProducts, total: float) -> np.ndarray:
    """``G^T d`` for the update's deviation from the big batch, ``d = t - sum_c G_c / N``."""
    return products.to_update - products.gram.sum(axis=1) / total


def _update_error(products: CellProducts, total: float, big_batch: float) -> float:
    """``|d| / |sum_c G_c / N|``: the update's distance to the big batch's, relative."""
    deviation_sq = (
        products.update_norm**2
        - 2.0 * float(products.to_update.sum()) / total
        + float(products.gram.sum()) / total**2
    )
    return math.sqrt(max(deviation_sq, 0.0)) / big_batch


def _form_error(weights: np.ndarray, layout: CellLayout, name: str) -> float:
    """The largest relative error of the fitted weights against one form's, over full cells."""
    full = layout.items > 0
    expected = form_weights(name, layout.items, k=layout.k, first_labels=layout.first_labels)
    return float(np.max(np.abs(weights[full] / expected[full] - 1)))
