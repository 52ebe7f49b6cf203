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
"""

from __future__ import annotations

import math

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


def micro_batch_clipped(
    weights: np.ndarray, layout: CellLayout, products: CellProducts
) -> tuple[np.ndarray, float]:
    """``clipped_per_micro_batch``'s weights for these fitted ones, and their ``c``.

    .. math::

       \\frac{w_{rm}}{1/N} = \\min\\left(1, \\frac{c}{|g_m|}\\right),\\quad
       |g_m|^2 = \\frac{1}{N^2} \\sum_{c, c' \\in m} A_{c c'},\\quad
       c = \\max_m \\frac{|\\sum_r w_{rm} G_{rm}|}{N}

    Args:
      weights: ``[R, k_window]`` fitted weights in units of ``1/N`` (NaN where empty).
      layout: the cells.
      products: the cells' Gram matrix (``products.gram``, cells in ``products.cells`` order).

    Returns:
      ``(weights [R, k_window] with NaN where empty, c)``.
    """
    total = float(layout.items.sum())
    fitted = weights[tuple(products.cells.T)]
    shares, clipped_shares = {}, {}
    for m in np.unique(products.cells[:, 1]):
        mine = products.cells[:, 1] == m
        block = products.gram[np.ix_(mine, mine)]
        shares[m] = math.sqrt(max(float(block.sum()), 0.0)) / total  # |g_m|
        share = fitted[mine] @ block @ fitted[mine]
        clipped_shares[m] = math.sqrt(max(float(share), 0.0)) / total  # |sum_r w_rm G_rm| / N
    clipped_to = max(clipped_shares.values())
    expected = np.full(layout.items.shape, np.nan)
    for (r, m), _ in zip(products.cells, fitted, strict=True):
        expected[r, m] = min(1.0, clipped_to / shares[m]) if shares[m] > 0 else np.nan
    return expected, clipped_to
