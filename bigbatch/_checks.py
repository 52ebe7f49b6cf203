"""The audits' checks of their input: the window's arguments, the layout, the update's
precision, the reference loss (that it adds up over rows), the invariance audit's cuts and
rows' items. Each raises a ``ValueError`` naming what to change."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bigbatch._forms import COUNT_FORMS, EXACT, FIXED_DIVISOR_TAIL, checkable_forms, form_weights
from bigbatch._layout import CellLayout, first_labels_of, layout_rows
from bigbatch._records import IGNORE_INDEX
from bigbatch._tolerances import ITEMS_RTOL, LOSS_RTOL, MAX_ROUNDING, SEPARATION


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
    check_learning_rate(learning_rate)
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


def check_learning_rate(learning_rate: object) -> float:
    """``learning_rate`` as a float; raises unless it is a finite number > 0 (at 0 no update
    moves: nothing to audit)."""
    if (
        isinstance(learning_rate, bool)
        or not isinstance(learning_rate, numbers.Real)
        or not np.isfinite(learning_rate)
        or learning_rate <= 0
    ):
        raise ValueError(f"learning_rate: expected a finite number > 0, got {learning_rate!r}")
    return float(learning_rate)


def check_max_grad_norm(max_grad_norm: object) -> float | None:
    """``max_grad_norm`` as a float, or None; raises unless it is None or a number > 0
    (``math.inf``: the loop does not clip).

    Example:
      >>> check_max_grad_norm(1), check_max_grad_norm(None), check_max_grad_norm(float("inf"))
      (1.0, None, inf)
    """
    if max_grad_norm is None:
        return None
    if (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, numbers.Real)
        or np.isnan(max_grad_norm)
        or max_grad_norm <= 0
    ):
        raise ValueError(
            "max_grad_norm: expected None, the threshold > 0 your loop clips the window's"
            f" gradient norm to, or math.inf if it does not clip; got {max_grad_norm!r}"
        )
    return float(max_grad_norm)


def check_layout(layout: CellLayout) -> tuple[str, ...]:
    """The forms the layout can tell apart; raises when its cells are too alike.

    Every bug that some window of this shape separates from the big batch must
    differ from it by at least ``SEPARATION`` (relative) in some cell of this
    one; otherwise the rows do not differ enough in items.

    Returns:
      The forms to check, in the order a verdict prefers them; ``"exact"``
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
            random = ", and the same loss on every call (no dropout, functional or module)"
            raise ValueError(
                f"loss_fn: expected a summed loss whose {what} adds up over rows; the batch gives"
                f" {whole:.6g}, its rows {parts.sum():.6g} in all: return a sum and its items (e.g."
                " jaxaccum.losses.causal_lm, torch_ref.causal_lm_loss_sum), not a mean"
                + (random if what == "loss_sum" else "")
            )


def refuse_row_items_with_loss_fn(row_items: object) -> None:
    """An invariance audit counts the rows' items by ``loss_fn`` or takes ``row_items``: both
    would be two counts."""
    if row_items is not None:
        raise ValueError(
            "row_items: pass it or loss_fn, not both: loss_fn's num_items are the rows' items"
        )


def check_cuts(cuts: Any, rows: int) -> list[tuple[int, int]]:
    """``cuts`` as ``(k, R)`` pairs of ints >= 1, at least two cells (``k R > 1``: one cell
    is the one-batch run itself), whose ``k R`` divides the rows (every cut uses every
    row); raises a ``ValueError`` naming ``cuts`` otherwise.

    Example:
      >>> check_cuts([(2, 1), (2, 2)], rows=8)
      [(2, 1), (2, 2)]
    """
    pairs = list(cuts) if isinstance(cuts, Sequence) else []
    is_count = lambda x: isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1
    ok = bool(pairs) and all(
        isinstance(c, Sequence) and len(c) == 2 and all(map(is_count, c)) and c[0] * c[1] > 1
        for c in pairs
    )
    if not ok:
        raise ValueError(
            "cuts: expected a non-empty list of (k, R) pairs of ints >= 1 with k R > 1 (a cut"
            f" of one cell is the one-batch run), got {cuts!r}"
        )
    for k, ranks in pairs:
        if rows % (k * ranks):
            raise ValueError(
                f"cuts: the cut k={k} x R={ranks} needs a multiple of {k * ranks} rows (every cut"
                f" uses every row); the batch has {rows}"
            )
    return [(int(k), int(ranks)) for k, ranks in pairs]


def row_items_of(batch: Any, row_items: Any, rows: int) -> np.ndarray:
    """The items of each row: ``row_items`` if given, else the targets of ``batch["labels"]``
    after the causal shift (``labels[:, 1:] != -100``), else one per row; checked.

    Example:
      >>> row_items_of({"labels": np.array([[1, 2, -100], [3, -100, -100]])}, None, rows=2)
      array([1., 0.])
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if row_items is None and labels is not None and np.ndim(labels) == 2:
        targets = np.asarray(labels)[:, 1:]
        other = np.unique(targets[(targets < 0) & (targets != IGNORE_INDEX)])
        if other.size:  # padding marked by another ignore index: every position would count
            raise ValueError(
                f"batch: its 'labels' hold {other[:5].tolist()}, not only {IGNORE_INDEX} where a"
                " row has no target: the rows' items cannot be counted from them; pass"
                " row_items= (or loss_fn=, whose num_items counts them)"
            )
        row_items = np.sum(targets != IGNORE_INDEX, axis=1)
    items = np.ones(rows) if row_items is None else np.asarray(row_items, np.float64)
    if items.shape != (rows,) or not np.all(np.isfinite(items)) or np.any(items < 0):
        raise ValueError(
            f"row_items: expected {rows} finite, non-negative items (one per row), got {items!r}"
        )
    return items
