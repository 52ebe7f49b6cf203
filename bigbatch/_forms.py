"""How the big batch and each known accumulation bug weigh an item of each cell.

A window is one optimizer update built from ``k`` micro-batches on each of
``R`` devices; a *cell* is one micro-batch on one device. With ``n_c`` the
items of cell ``c`` (valid tokens, or samples), ``N_r`` those of its device
and ``N`` those of the window, every known bug computes the window gradient as
a reweighting of the gradients ``G_c`` of the cells' SUMMED losses::

    g = sum_c w_c * G_c

and differs only in ``w_c`` (``docs/math.md`` derives each one):

    exact                   1 / N
    mean_of_means           1 / (k R n_c)         k: the micro-batches this window holds
    mean_of_global_means    1 / (k M_m)           M_m = sum_r n_rm: micro-batch m's items
    missing_1_over_k        1 / (R n_c)
    local_denominator       1 / (R N_r)
    ddp_average_forgotten   1 / (R N)
    fixed_divisor_tail      (k_tail / k) / N      (a short window of k_tail < k micro-batches)

and one miscount of ``N`` itself (:data:`COUNT_FORMS`), a uniform scale:

    first_label_counted     1 / (N + F)           F: rows whose label at position 0 is set

and one clipping of each micro-batch by its norm (:data:`CLIP_FORMS`; its weights
depend on the gradients, ``bigbatch._clipping``):

    clipped_per_micro_batch min(1, c / |g_m|) / N  g_m = sum_r G_rm / N: micro-batch m's share

Here every weight is written as a multiple of the big batch's ``1 / N``, so
``exact`` is 1 in every cell. In a short window of ``k_tail`` micro-batches the
means are averaged over ``k_tail`` (``len(microbatches)``, Hugging Face's
current accumulation steps); a loop that divides the tail by the nominal ``k``
(nanoGPT's constant) weighs ``k_tail / k`` of that, a second bug
(``docs/math.md`` section 6), which the audit's note names. ``mean_of_global_means``
is what a mean per micro-batch computes under a global view of the devices
(``jax.jit`` with the batch sharded, GSPMD): on one device it *is* ``mean_of_means``.
"""

from __future__ import annotations

import numpy as np

EXACT = "exact"
"""The big batch's form: every item weighs ``1/N``."""
UNKNOWN = "unknown"
"""The verdict when no known form fits."""
MEAN_OF_MEANS = "mean_of_means"
"""Each micro-batch takes its own mean, the ``k R`` means are averaged: ``1 / (k R n_c)``."""
MEAN_OF_GLOBAL_MEANS = "mean_of_global_means"
"""A mean per micro-batch over all devices (GSPMD's global view), averaged: ``1 / (k M_m)``."""
MISSING_1_OVER_K = "missing_1_over_k"
LOCAL_DENOMINATOR = "local_denominator"
DDP_AVERAGE_FORGOTTEN = "ddp_average_forgotten"
FIXED_DIVISOR_TAIL = "fixed_divisor_tail"
FIRST_LABEL_COUNTED = "first_label_counted"
CLIPPED_PER_MICRO_BATCH = "clipped_per_micro_batch"
"""Each micro-batch's gradient clipped by its own norm before the window adds them."""

BUG_NAMES: tuple[str, ...] = (
    MEAN_OF_MEANS,
    MEAN_OF_GLOBAL_MEANS,
    MISSING_1_OVER_K,
    LOCAL_DENOMINATOR,
    DDP_AVERAGE_FORGOTTEN,
    FIXED_DIVISOR_TAIL,
)
"""The reweighting bugs, with the names of ``torch_ref.buggy`` (``mean_of_global_means``
aside: a DDP loop has no global view of a micro-batch)."""

FORM_NAMES: tuple[str, ...] = (EXACT, *BUG_NAMES)
"""Every known reweighting form, in the order a verdict prefers them when two fit."""

COUNT_FORMS: tuple[str, ...] = (FIRST_LABEL_COUNTED,)
"""Miscounts of the window's items: checked when the rows' labels are known (the audit reads
``batch["labels"]``), after every form of :data:`FORM_NAMES`."""

CLIP_FORMS: tuple[str, ...] = (CLIPPED_PER_MICRO_BATCH,)
"""Clippings of each micro-batch by its norm: weights that depend on the micro-batches'
gradients and a threshold (``bigbatch._clipping``); checked last. (Clipping the window
once is no form of its own: it scales a form's weights by one factor, ``report.clip_scale``.)"""

_SAME_ON_ONE_DEVICE = {MEAN_OF_GLOBAL_MEANS: MEAN_OF_MEANS}  # there, the verdict is the latter

FORMULAS: dict[str, str] = {
    EXACT: "1/N",
    MEAN_OF_MEANS: "1/(k R n_c)",
    MEAN_OF_GLOBAL_MEANS: "1/(k M_m)",
    MISSING_1_OVER_K: "1/(R n_c)",
    LOCAL_DENOMINATOR: "1/(R N_r)",
    DDP_AVERAGE_FORGOTTEN: "1/(R N)",
    FIXED_DIVISOR_TAIL: "(k_tail/k)/N",
    FIRST_LABEL_COUNTED: "1/(N+F)",
    CLIPPED_PER_MICRO_BATCH: "min(1, c/|g_m|)/N",
}
"""The weight of an item of cell ``c`` under each form."""

WHAT_IT_DOES: dict[str, str] = {
    EXACT: "the big batch: one mean over all the window's items",
    MEAN_OF_MEANS: "each micro-batch takes its own mean, then the k means are averaged",
    MEAN_OF_GLOBAL_MEANS: "each micro-batch takes its own mean over all devices (a global view:"
    " jax.jit on a sharded batch), then the k means are averaged",
    MISSING_1_OVER_K: "each micro-batch's mean is added without dividing by k",
    LOCAL_DENOMINATOR: "each device divides by its own items, then devices are averaged",
    DDP_AVERAGE_FORGOTTEN: "summed loss / N per device, then the devices are averaged, not added",
    FIXED_DIVISOR_TAIL: "a short window is still divided as if it had k micro-batches",
    FIRST_LABEL_COUNTED: "the items are counted before the causal shift: each row's label at"
    " position 0, never a target, is counted too",
    CLIPPED_PER_MICRO_BATCH: "each micro-batch's gradient is clipped by its norm alone (to c),"
    " then the micro-batches are added",
}
"""What the code of each form does, in words (the report says it of its verdict)."""

FIXES: dict[str, str] = {
    EXACT: "nothing to fix",
    MEAN_OF_MEANS: "accumulate summed losses and their items; divide once, by the window's N",
    MEAN_OF_GLOBAL_MEANS: "accumulate summed losses and their items; divide once, by the"
    " window's N (over all micro-batches, not each one's)",
    MISSING_1_OVER_K: "divide once by the window's N (then there is no 1/k to forget)",
    LOCAL_DENOMINATOR: "add the items over devices before dividing (N, not N_r)",
    DDP_AVERAGE_FORGOTTEN: "add the device gradients (psum), or multiply the loss by R",
    FIXED_DIVISOR_TAIL: "divide a short window by its own items",
    FIRST_LABEL_COUNTED: "count labels[:, 1:] != -100 (the targets after the shift)",
    CLIPPED_PER_MICRO_BATCH: "clip the window's gradient once, at the boundary (e.g."
    " jaxaccum.multi_steps(..., max_grad_norm=c))",
}
"""The fix of each form, in words (the report says it of its verdict)."""


def form_weights(
    name: str, items: np.ndarray, *, k: int, first_labels: np.ndarray | None = None
) -> np.ndarray:
    """The weight of an item of each cell under one known form, in units of ``1/N``.

    .. math::

       \\frac{w_c}{1/N} = 1,\\ \\frac{N}{k_w R n_c},\\ \\frac{N}{k_w M_m},\\ \\frac{N}{R n_c},\\
       \\frac{N}{R N_r},\\ \\frac{1}{R},\\ \\frac{k_w}{k},\\ \\frac{N}{N + F}

    for ``exact``, ``mean_of_means``, ``mean_of_global_means``, ``missing_1_over_k``,
    ``local_denominator``, ``ddp_average_forgotten``, ``fixed_divisor_tail`` and
    ``first_label_counted``, with ``k_w`` the window's micro-batches (``k``, or
    ``k_tail`` in a short window).

    Args:
      name: one of :data:`FORM_NAMES` or :data:`COUNT_FORMS`.
      items: ``[R, k_window]`` items of each cell (device ``r``, micro-batch
        ``m``); ``k_window`` is ``k``, or ``k_tail < k`` in a short window.
      k: the nominal number of micro-batches per window.
      first_labels: ``[R, k_window]`` rows of each cell whose label at position
        0 is set (``first_label_counted`` only; NaN weights without it).

    Returns:
      ``[R, k_window]`` float64 weights as multiples of the big batch's
      ``1/N``; NaN for a cell without items (its gradient is zero, whatever
      its weight).

    Example:
      >>> import numpy as np
      >>> form_weights("mean_of_means", np.array([[3.0, 1.0]]), k=2)  # N = 4
      array([[0.66666667, 2.        ]])
    """
    if name not in FORM_NAMES + COUNT_FORMS:
        raise ValueError(f"name: expected one of {FORM_NAMES + COUNT_FORMS}, got {name!r}")
    items = np.asarray(items, np.float64)
    if items.ndim != 2 or items.size == 0 or np.any(items < 0) or not np.all(np.isfinite(items)):
        raise ValueError(
            "items: expected a non-empty [num_devices, micro_batches] array of finite, non-negative"
            f" items per cell; got {items!r}"
        )
    num_devices, k_window = items.shape
    total = items.sum()
    first = np.nan if first_labels is None else float(np.sum(first_labels))
    device_items = np.broadcast_to(items.sum(axis=1, keepdims=True), items.shape)
    microbatch_items = np.broadcast_to(items.sum(axis=0, keepdims=True), items.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        weights = {
            EXACT: np.ones_like(items),
            MEAN_OF_MEANS: total / (k_window * num_devices * items),
            MEAN_OF_GLOBAL_MEANS: total / (k_window * microbatch_items),
            MISSING_1_OVER_K: total / (num_devices * items),
            LOCAL_DENOMINATOR: total / (num_devices * device_items),
            DDP_AVERAGE_FORGOTTEN: np.full_like(items, 1.0 / num_devices),
            FIXED_DIVISOR_TAIL: np.full_like(items, k_window / k),
            FIRST_LABEL_COUNTED: np.full_like(items, total / (total + first)),
        }[name]
    return np.where(items > 0, weights, np.nan)


def checkable_forms(num_devices: int, k_window: int, *, k: int) -> tuple[str, ...]:
    """The forms that some window of this shape can tell apart from the big batch.

    A bug that weighs every cell like the big batch whatever the items is no
    bug on this shape (a local denominator on one device is the global one; a
    fixed divisor needs a short window; dividing a one-cell window by its own
    items is right). Decided on a window whose cells all hold different items.
    On one device ``mean_of_global_means`` *is* ``mean_of_means``: only the
    latter is checked there.

    Args:
      num_devices: ``R``.
      k_window: the micro-batches of the window (``k``, or ``k_tail``).
      k: the nominal micro-batches per window.

    Returns:
      ``exact`` and the bug names that differ from it on such a window, in
      :data:`FORM_NAMES` order.

    Example:
      >>> checkable_forms(1, 4, k=4)
      ('exact', 'mean_of_means', 'missing_1_over_k')
    """
    distinct = np.arange(1.0, num_devices * k_window + 1.0).reshape(num_devices, k_window)
    return tuple(
        name
        for name in FORM_NAMES
        if name == EXACT
        or not (
            np.allclose(form_weights(name, distinct, k=k), 1.0)
            or (num_devices == 1 and name in _SAME_ON_ONE_DEVICE)
        )
    )
