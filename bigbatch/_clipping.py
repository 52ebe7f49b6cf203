"""Clipping by norm, read off the fitted weights: once per window, or per micro-batch.

**Once per window** (``g <- min(1, c / |g|) g`` at the boundary: ``jaxaccum.multi_steps(...,
max_grad_norm=c)``, ``torch.nn.utils.clip_grad_norm_`` before ``optimizer.step()``, MaxText,
the Hugging Face Trainer) is no form of its own: it multiplies every weight of the loop's
form by one factor ``s = min(1, c / |g|)``. The fit reads ``s`` off the weights (the form's
times ``s < 1``) and ``c = s |g|`` off the update: the norm of the applied gradient. A form
that is the big batch times a constant (a forgotten DDP average, a fixed divisor, a miscount)
clipped is the big batch clipped: the clip erases the constant.

**Per micro-batch** (each micro-batch's gradient clipped alone before adding: Praxis, Paxml,
``torch_ref.buggy``'s ``clip_per_microbatch``, an ``optax.chain(clip_by_global_norm(c),
accumulator)``) weighs the cells ``(r, m)`` of micro-batch ``m``, in units of ``1/N``::

    min(1, c / |g_m|),      g_m = sum_r G_rm / N     (micro-batch m's share of the big batch)

``|g_m|`` comes from the cells' Gram matrix, and ``c`` is the norm every clipped
micro-batch's share is cut to: the largest norm of a fitted share ``sum_r w_rm G_rm / N``
(an unclipped micro-batch's is below ``c``). Clipping the summed-loss gradient to ``c'``
before dividing by ``N`` (lesson 5's ``optax.chain``) is the same form with ``c = c' / N``.
Before their clip the micro-batches may be weighed by another form than the big batch's
(``optax.chain(clip_by_global_norm(c), optax.MultiSteps(...))`` clips each micro-batch's
MEAN: a mean of means, clipped): the share is then ``sum_r b_rm G_rm / N`` with ``b`` that
form's weights, and the audit tries the forms in their order (the big batch's first).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from bigbatch._forms import form_weights
from bigbatch._layout import CellLayout
from bigbatch._products import CellProducts
from bigbatch._tolerances import WEIGHT_RTOL

_PROPORTIONAL_RTOL = 1e-9  # two forms' weights in a constant ratio: float64 arithmetic on counts


def expected_weights(name: str, layout: CellLayout) -> np.ndarray:
    """``form_weights`` of ``name`` on the layout's cells (``[R, k_window]``, NaN where empty)."""
    return form_weights(name, layout.items, k=layout.k, first_labels=layout.first_labels)


def scaled_error(weights: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """``(s, error)``: the factor ``s`` that brings ``expected`` closest to ``weights`` (the
    largest relative error the least), and that error, over cells with a finite weight.

    .. math::

       s = \\frac{\\max_c r_c + \\min_c r_c}{2}, \\quad
       \\mathrm{error} = \\frac{\\max_c r_c - \\min_c r_c}{\\max_c r_c + \\min_c r_c},
       \\quad r_c = \\frac{w_c}{e_c}

    Example:
      >>> scaled_error(np.array([[0.5, 0.5]]), np.array([[1.0, 1.0]]))
      (0.5, 0.0)
    """
    full = np.isfinite(weights) & np.isfinite(expected)
    ratios = weights[full] / expected[full]
    low, high = float(np.min(ratios)), float(np.max(ratios))
    if not low + high > 0:
        return 0.0, math.inf
    return (low + high) / 2, (high - low) / (high + low)


def window_clipped(
    weights: np.ndarray, layout: CellLayout, forms: tuple[str, ...]
) -> tuple[tuple[str, float], ...]:
    """The forms whose weights times one factor ``s < 1`` are the fitted ones, as ``(form, s)``.

    Forms in a constant ratio to an earlier match are left out (clipped, ``k`` times a
    mean of means is a mean of means; a constant times the big batch, the big batch).

    Example:
      >>> from bigbatch import layout_rows
      >>> layout = layout_rows(np.array([1.0, 3.0]), k=2, num_devices=1)
      >>> window_clipped(np.array([[0.5, 0.5]]), layout, ("exact", "mean_of_means"))
      (('exact', 0.5),)
    """
    found: list[tuple[str, float, np.ndarray]] = []
    for name in forms:
        expected = expected_weights(name, layout)
        scale, error = scaled_error(weights, expected)
        if not (error <= WEIGHT_RTOL and 0 < scale < 1 - WEIGHT_RTOL):
            continue
        if any(scaled_error(expected, other)[1] <= _PROPORTIONAL_RTOL for *_, other in found):
            continue
        found.append((name, scale, expected))
    return tuple((name, scale) for name, scale, _ in found)


class MicroBatchClip(NamedTuple):
    """``clipped_per_micro_batch`` fitted to a loop's weights.

    Attributes:
      base: the form each micro-batch is weighed by before its clip (``exact``: its
        share of the big batch).
      weights: ``[R, k_window]`` the form's weights (NaN where a cell is empty).
      clipped_to: ``c``, the norm each clipped micro-batch's share is cut to.
      error: the largest relative error of the fitted weights against ``weights``.
    """

    base: str
    weights: np.ndarray
    clipped_to: float
    error: float


def micro_batch_clipped(
    weights: np.ndarray, layout: CellLayout, products: CellProducts, forms: tuple[str, ...]
) -> MicroBatchClip | None:
    """``clipped_per_micro_batch`` on the first base form of ``forms`` that fits the weights
    (the closest if none does): :func:`clipped_weights` of each. A base whose fit clips no
    micro-batch is that form itself, not this one: None if every base is such.

    Example:
      >>> from bigbatch import cell_products, layout_rows
      >>> layout = layout_rows(np.array([1.0, 3.0]), k=2, num_devices=1)  # N = 4
      >>> grads = [np.array([10.0, 0.0]), np.array([0.0, 3.0])]  # |g_m| = 2.5 and 0.75
      >>> products = cell_products(lambda r, m: [grads[m]], [np.array([-0.25, -0.25])],
      ...                          layout, learning_rate=1.0, progress=False)
      >>> fit = micro_batch_clipped(np.array([[0.1, 1 / 3]]), layout, products, ("exact",))
      >>> fit.base, fit.clipped_to, fit.weights.round(4).tolist()  # both cut to norm 0.25
      ('exact', 0.25, [[0.1, 0.3333]])
    """
    fits = []
    full = layout.items > 0
    for base in forms:
        expected, clipped_to = clipped_weights(weights, layout, products, base)
        before = expected_weights(base, layout)
        if not np.any(expected[full] < (1 - WEIGHT_RTOL) * before[full]):
            continue  # nothing clipped
        error = float(np.max(np.abs(weights[full] / expected[full] - 1)))
        fits.append(MicroBatchClip(base, expected, clipped_to, error))
        if error <= WEIGHT_RTOL:
            return fits[-1]
    return min(fits, key=lambda fit: fit.error, default=None)


def clipped_weights(
    weights: np.ndarray, layout: CellLayout, products: CellProducts, base: str
) -> tuple[np.ndarray, float]:
    """``clipped_per_micro_batch``'s weights on the form ``base`` for these fitted weights, and ``c``.

    .. math::

       w_{rm} = b_{rm} \\min\\left(1, \\frac{c}{|g_m|}\\right),\\quad
       |g_m|^2 = \\frac{b_m^T A_{mm} b_m}{N^2},\\quad
       c = \\max_m \\frac{\\sqrt{w_m^T A_{mm} w_m}}{N}

    with ``b`` the base form's weights and ``A_mm`` the Gram matrix of micro-batch
    ``m``'s cells (a micro-batch's share is ``sum_r b_rm G_rm / N``).

    Args:
      weights: ``[R, k_window]`` fitted weights in units of ``1/N`` (NaN where empty).
      layout: the cells.
      products: the cells' Gram matrix (``products.gram``, cells in ``products.cells`` order).
      base: the form the micro-batches are weighed by before the clip.

    Returns:
      ``(weights [R, k_window] with NaN where empty, c)``.
    """
    total = float(layout.items.sum())
    cells = tuple(products.cells.T)
    fitted, before = weights[cells], expected_weights(base, layout)[cells]
    expected = np.full(layout.items.shape, np.nan)
    norms, clipped_norms = {}, {}
    for m in np.unique(products.cells[:, 1]):
        mine = products.cells[:, 1] == m
        block = products.gram[np.ix_(mine, mine)]
        norms[m] = _norm(before[mine], block) / total  # |g_m|, the share before the clip
        clipped_norms[m] = _norm(fitted[mine], block) / total  # as the loop applied it
    clipped_to = max(clipped_norms.values())
    for (r, m), b in zip(products.cells, before, strict=True):
        expected[r, m] = b * min(1.0, clipped_to / norms[m]) if norms[m] > 0 else np.nan
    return expected, clipped_to


def _norm(weights: np.ndarray, gram: np.ndarray) -> float:
    """``|sum_c w_c G_c|`` from the Gram matrix of the ``G_c``."""
    return math.sqrt(max(float(weights @ gram @ weights), 0.0))
