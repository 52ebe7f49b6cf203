"""From a loop's update to the weights it gives each cell, and the verdict.

With plain SGD the update of one window is ``delta = -lr * g``. Every known
accumulation bug computes ``g`` as a reweighting of the gradients ``G_c`` of
the cells' summed losses (``_forms.py``)::

    -delta / lr = sum_c w_c G_c + e

so the weights are a least-squares fit (float64) over the cells that hold
items, computed from the cells' inner products (``_products.py``: memory of
the parameters' size, whatever the number of cells), and the residual
``|e| / |delta / lr|`` says whether the loop is a reweighting at all. The
weights are then compared with each known form, as they are and clipped
(``_clipping.py``). The tolerances, and why: ``_tolerances.py``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from bigbatch._checks import check_layout, check_max_grad_norm, check_precision
from bigbatch._clipping import (
    expected_weights,
    micro_batch_clipped,
    window_clipped,
)
from bigbatch._forms import CLIPPED_PER_MICRO_BATCH, EXACT
from bigbatch._layout import CellLayout
from bigbatch._products import CellProducts
from bigbatch._report import UNKNOWN, AuditReport
from bigbatch._tolerances import CLIP_RTOL, FIT_NOISE, MAX_CONDITION, RESIDUAL_RTOL, WEIGHT_RTOL


class _Verdict(NamedTuple):
    """The form the weights have: its name, every form that fits as well, the clip."""

    name: str
    matches: tuple[str, ...]
    weights: np.ndarray | None = None  # the verdict's weights (its form's, as clipped)
    clip_scale: float = 1.0
    clipped_to: float | None = None
    clip_base: str | None = None  # clipped per micro-batch: the form before the clip


def audit_update(
    products: CellProducts,
    layout: CellLayout,
    *,
    learning_rate: float,
    params_rounding: float = 0.0,
    max_grad_norm: float | None = None,
) -> AuditReport:
    """Fits the weights a loop gave each cell, and names the form they have.

    .. math::

       w = A^{-1} G^T t, \\qquad
       \\mathrm{residual} = \\frac{\\sqrt{|t|^2 - t^T G A^{-1} G^T t}}{|t|},
       \\qquad t = -\\delta / lr

    the least-squares weights of ``-delta / lr = G w + e`` over the cells with
    items, from the products of :func:`cell_products` (``A = G^T G``). Provided
    the residual is at most ``RESIDUAL_RTOL``, the verdict is the first form of
    ``check_layout(layout)`` whose weights are within ``WEIGHT_RTOL`` of ``w N``
    in every such cell (one 10x closer than the first goes first, where the first
    is off by more than ``FIT_NOISE``); else the first whose weights times one factor
    ``s < 1`` are (the window clipped once to ``c = s |g|``; first of all when
    the applied gradient's norm is the ``max_grad_norm`` you passed); else
    ``clipped_per_micro_batch`` if its weights are; else ``"unknown"``.

    Args:
      products: the :class:`CellProducts` of the loop's update and the cells.
      layout: the :class:`bigbatch.CellLayout` the loop was fed.
      learning_rate: the SGD learning rate the loop was given.
      params_rounding: ``|eps(dtype) * params|``, the rounding of reading the
        update back as ``new - old`` (:func:`check_precision` refuses an update
        too small for it).
      max_grad_norm: the threshold your loop clips the window's gradient to, if
        any: the report says whether it does (``AuditReport.clip_kept``).

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
    max_grad_norm = check_max_grad_norm(max_grad_norm)
    forms = check_layout(layout)
    total = float(layout.items.sum())
    condition = _condition(products.gram)
    big_batch = math.sqrt(max(float(products.gram.sum()), 0.0)) / total  # |sum_c G_c| / N
    rounding = _relative(params_rounding, learning_rate * big_batch)
    check_precision(rounding, learning_rate)
    weights, residual = _fit(products, layout.items)
    errors, per_micro_batch = _form_errors(weights, layout, products, forms)
    verdict = _verdict(weights, errors, forms, layout, products.update_norm, residual,
                       max_grad_norm, per_micro_batch)  # fmt: skip
    full = layout.items > 0
    weights.flags.writeable = False
    return AuditReport(
        verdict=verdict.name,
        weights=weights,
        items=layout.items,
        residual=residual,
        scale=float(np.sum(layout.items[full] * weights[full]) / total),
        max_weight_error=errors[EXACT],
        update_error=_update_error(products, total, big_batch),
        form_errors=errors,
        matches=verdict.matches,
        k=layout.k,
        first_labels=layout.first_labels,
        condition=condition,
        residual_tolerance=RESIDUAL_RTOL,
        weight_tolerance=WEIGHT_RTOL,
        rounding=float(rounding),
        update_rounding=_relative(params_rounding, learning_rate * products.update_norm),
        left_out_rows=int(layout.left_out.size),
        verdict_weights=verdict.weights,
        clip_scale=verdict.clip_scale,
        clipped_to=verdict.clipped_to,
        clip_base=verdict.clip_base,
        grad_norm=products.update_norm / verdict.clip_scale,
        max_grad_norm=max_grad_norm,
        clip_tolerance=CLIP_RTOL,
    )


def _relative(rounding: float, norm: float) -> float:
    """``rounding / norm``; inf where the norm is not above 0 (none, or NaN)."""
    return rounding / norm if norm > 0 else math.inf


def _form_errors(weights, layout, products, forms) -> tuple[dict[str, float], Any]:
    """Each form's largest relative weight error against the fitted ``weights``, and the fit
    of ``clipped_per_micro_batch`` (None where it cannot be told from the window's)."""
    per_micro_batch = None
    if layout.k_window >= 2 and 0 < products.update_norm < math.inf:
        per_micro_batch = micro_batch_clipped(weights, layout, products, forms)
    with np.errstate(invalid="ignore"):
        errors = {name: _form_error(weights, expected_weights(name, layout)) for name in forms}
    if per_micro_batch is not None:
        errors[CLIPPED_PER_MICRO_BATCH] = per_micro_batch.error
    return errors, per_micro_batch


def _verdict(
    weights, errors, forms, layout, applied, residual, max_grad_norm, per_micro_batch
) -> _Verdict:
    """The first form that fits, as it is, clipped once per window, or clipped per micro-batch.

    ``applied`` is ``|t|``, the norm of the applied gradient. A window clipped to the
    ``max_grad_norm`` you passed is read as clipped first: a constant factor that the clip
    erased (a forgotten DDP average, say) is no bug then.
    """
    if not (applied > 0 and residual <= RESIDUAL_RTOL):  # nothing moved, NaN, no reweighting
        return _Verdict(UNKNOWN, ())
    unclipped = _best_first(tuple(name for name in forms if errors[name] <= WEIGHT_RTOL), errors)
    no_clip = max_grad_norm is not None and math.isinf(max_grad_norm)  # you said it does not
    clipped = () if no_clip else window_clipped(weights, layout, forms)
    clips = max_grad_norm is not None and math.isfinite(max_grad_norm)
    at_threshold = clips and abs(applied - max_grad_norm) <= CLIP_RTOL * max_grad_norm
    if unclipped and not (at_threshold and clipped):
        return _Verdict(unclipped[0], unclipped, expected_weights(unclipped[0], layout))
    if clipped:
        name, scale = clipped[0]
        scaled = scale * expected_weights(name, layout)
        return _Verdict(name, tuple(n for n, _ in clipped), scaled, scale, applied)
    if per_micro_batch is not None and per_micro_batch.error <= WEIGHT_RTOL:
        name, fit = CLIPPED_PER_MICRO_BATCH, per_micro_batch
        return _Verdict(name, (name,), fit.weights, 1.0, fit.clipped_to, fit.base)
    return _Verdict(UNKNOWN, ())


def _best_first(names: tuple[str, ...], errors: dict[str, float]) -> tuple[str, ...]:
    """The matching forms, the first moved ahead by one that fits far better: both within
    the tolerance, the first off by more than float32 noise can explain (a bug of 1e-4 to
    1e-3, one label in a thousand counted), the other at least 10x closer."""
    if len(names) < 2:
        return names
    best = min(names, key=lambda name: errors[name])
    first = errors[names[0]]
    if first > FIT_NOISE and errors[best] * 10 < first:
        return (best, *(name for name in names if name != best))
    return names


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


def _form_error(weights: np.ndarray, expected: np.ndarray) -> float:
    """The largest relative error of the fitted weights against a form's, over full cells
    (``expected`` is NaN where a cell has no item)."""
    full = ~np.isnan(expected)
    return float(np.max(np.abs(weights[full] / expected[full] - 1)))
