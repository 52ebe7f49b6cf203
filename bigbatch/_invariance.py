"""Is one update invariant to how its window is cut into micro-batches and ranks?

The same rows, one optimizer update (SGD), under several cuts: the one-batch run
(``k = 1``, ``R = 1``) and ``k`` micro-batches on each of ``R`` ranks. A loop whose
objective is a mean over the whole window gives the same update for every cut,
whatever the objective (token mean, sequence mean, a constant denominator); a
loop that normalizes per micro-batch or per rank does not. No reference loss is
needed for the verdict: only the updates.

Where the rows' own gradients are known (a reference loss per row, or TRL's
policy term per sequence), each update is also fitted as a reweighting of them
(the audit's fit, with rows as cells, ``_products.py``), and a cut's weights are
reported relative to the one-batch run's: 1 for every row of an invariant loop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from bigbatch._checks import check_max_grad_norm
from bigbatch._products import dot, stream_products
from bigbatch._tolerances import CLIP_RTOL, MAX_CONDITION, RESIDUAL_RTOL

INVARIANCE_RTOL = 1e-5
"""The largest relative difference of an invariant update from the one-batch one: float32
gradients added in another order and the update read back as ``new - old`` differ by
~1e-7 to 1e-6 (measured up to 7e-7 on TRL's trainer); a cut-dependent normalization moves
the update by percents."""

Leaves = list[np.ndarray]


# Fitted row weights this far from 1 are a weighting, not the fit's noise, for cells that
# carry a fair share of the update (the noise is about the update's rounding over the cell's
# share: ~1e-6 at a share of ~1, 3e-3 at 1e-3); cells of a tinier share can cross it too.
WEIGHTS_APART = 0.01


@dataclasses.dataclass(frozen=True, eq=False)
class InvarianceReport:
    """How far each cut's update is from the one-batch update of the same rows.

    ``assert report.invariant, report`` fails with a one-line summary;
    ``print(report)`` shows the table.

    Attributes:
      cuts: each cut's name (``"k=4 x R=2"``).
      differences: float64 ``[cuts]``, ``|delta_cut - delta_one| / |delta_one|``.
      tolerance: the largest difference of an invariant update (``INVARIANCE_RTOL``).
      row_items: float64 ``[rows]``, the items of each row.
      weights: float64 ``[cuts, rows]``, each row's weight in the cut's update over
        its weight in the one-batch update (1 for every row of an invariant loop;
        NaN for a row without items), or None where the rows' gradients are not
        known or cannot be told apart.
      residuals: float64 ``[cuts + 1]``, how far each update (the one-batch one
        first) is from a reweighting of the rows' gradients (the audit's
        residual), or None.
      note: why there are no weights, if there are none; what the one-batch run
        did with the ``max_grad_norm`` you passed, if you passed one.
      one_batch_norm: ``|delta_one| / lr``, the norm of the gradient the one-batch
        run applied (``max_grad_norm`` when it clipped the whole batch).
      max_grad_norm: the threshold you passed, or None.
    """

    cuts: tuple[str, ...]
    differences: np.ndarray
    tolerance: float
    row_items: np.ndarray
    weights: np.ndarray | None = None
    residuals: np.ndarray | None = None
    note: str = ""
    one_batch_norm: float = math.nan
    max_grad_norm: float | None = None

    @property
    def invariant(self) -> bool:
        """Whether every cut gives the one-batch update (within ``tolerance``)."""
        return bool(np.all(self.differences <= self.tolerance))

    @property
    def worst(self) -> float:
        """The largest relative difference from the one-batch update over the cuts."""
        return float(np.max(self.differences))

    @property
    def breaking(self) -> str | None:
        """The cut that changes the update the most, if any changes it beyond the tolerance."""
        return None if self.invariant else self.cuts[int(np.argmax(self.differences))]

    def summary(self) -> str:
        if self.invariant:
            return (
                f"INVARIANT: every cut gives the one-batch update (within {self.worst:.1e};"
                f" tolerance {self.tolerance:.0e})"
            )
        return (
            f"NOT INVARIANT: {self.breaking} changes the update by {self.worst:.1e} (tolerance"
            f" {self.tolerance:.0e})"
        )

    def __repr__(self) -> str:
        return f"InvarianceReport({self.summary()}; print(report) for the table)"

    def __str__(self) -> str:
        rows = [["cut", "difference", "invariant", "row weights (x one batch)", "residual"]]
        residual = lambda i: "-" if self.residuals is None else f"{self.residuals[i]:.1e}"
        rows.append(["one batch", "-", "-", "1", residual(0)])
        for i, cut in enumerate(self.cuts):
            ok = "yes" if self.differences[i] <= self.tolerance else "NO"
            rows.append([cut, f"{self.differences[i]:.1e}", ok, self._weights(i), residual(i + 1)])
        widths = [max(len(row[j]) for row in rows) for j in range(len(rows[0]))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        items = f"{self.row_items.size} rows, {self.row_items.sum():g} items"
        header = (
            f"Invariance of one SGD update to the cut of its window ({items}): {self.summary()}"
        )
        notes = ([self.note] if self.note else []) + self._weights_apart()
        return "\n".join([header, "", *(line.rstrip() for line in lines), "", *notes]).rstrip()

    def _weights_apart(self) -> list[str]:
        """A note for each cut within the tolerance whose fitted row weights are not the
        one batch's (beyond ``WEIGHTS_APART``): a term too small to move the update."""
        if self.weights is None:
            return []
        apart = lambda i: np.any(np.abs(self.weights[i] - 1.0) > WEIGHTS_APART)  # NaN: False
        return [
            f"{cut} is within the tolerance, but its fit weighs rows {self._weights(i)}x the"
            " one batch's: a term too small to move the update beyond the tolerance (a small"
            " coefficient) weighs its rows otherwise, or the fit cannot tell their weights"
            for i, cut in enumerate(self.cuts)
            if self.differences[i] <= self.tolerance and apart(i)
        ]

    def _weights(self, i: int) -> str:
        """The range of the cut's row weights, ``"0.52-2.1"`` (``"1.00"`` when all agree)."""
        if self.weights is None:
            return "-"
        w = self.weights[i][~np.isnan(self.weights[i])]
        low, high = f"{np.min(w):#.3g}", f"{np.max(w):#.3g}"
        return low if low == high else f"{low}-{high}"


def invariance_report(
    cuts: Sequence[str],
    one_batch: Leaves,
    cut_updates: Sequence[Leaves],
    *,
    row_items: np.ndarray,
    row_grad: Callable[[int], Sequence[np.ndarray]] | None = None,
    progress: bool = True,
    learning_rate: float = 1.0,
    max_grad_norm: float | None = None,
) -> InvarianceReport:
    """Compares each cut's update with the one-batch update, and fits the rows' weights.

    .. math::

       \\mathrm{difference} = \\frac{|\\delta_{cut} - \\delta_{one}|}{|\\delta_{one}|},
       \\qquad \\delta = \\sum_i w_i G_i + e,\\quad \\frac{w_i^{cut}}{w_i^{one}}

    Args:
      cuts: the cuts' names.
      one_batch: the parameter change of the one-batch run, float64 leaves.
      cut_updates: each cut's parameter change, leaves in the same order.
      row_items: ``[rows]`` the items of each row.
      row_grad: ``row_grad(i)``, the leaves of row ``i``'s gradient (rows with
        items only), or None: no weights.
      progress: a tqdm bar while the rows' gradients are computed.
      learning_rate: the SGD learning rate of the runs (the one-batch run's
        gradient norm is ``|delta_one| / lr``).
      max_grad_norm: the threshold the loop clips to, if any: the note says
        whether the one-batch run clipped (the reference is then the whole
        batch's gradient clipped to it, which a loop that clips its window once
        gives on every cut).

    Returns:
      An :class:`InvarianceReport`.

    Raises:
      ValueError: a one-batch update of norm 0, NaN or inf: nothing to compare with.
    """
    updates = [[np.ascontiguousarray(x, np.float64) for x in u] for u in (one_batch, *cut_updates)]
    norms = np.array([math.sqrt(dot(u, u)) for u in updates])
    if not 0 < norms[0] < math.inf:
        raise ValueError(
            f"one_batch: the one-batch run's update has norm {norms[0]:g}: nothing to compare"
            " the cuts with (a loop that does not step, a learning rate or a gradient of 0,"
            " advantages all 0, or NaN/inf in the update)"
        )
    differences = np.array([_distance(u, updates[0]) / norms[0] for u in updates[1:]])
    report = InvarianceReport(
        cuts=tuple(cuts),
        differences=differences,
        tolerance=INVARIANCE_RTOL,
        row_items=np.asarray(row_items, np.float64),
        one_batch_norm=float(norms[0] / learning_rate),
        max_grad_norm=check_max_grad_norm(max_grad_norm),
    )
    report = dataclasses.replace(report, note=_joined(_clip_note(report), _equal_rows(report)))
    if row_grad is None:
        return report
    rows = np.argwhere(report.row_items > 0)
    gram, to_updates, _ = stream_products(row_grad, rows, updates, progress=progress)
    eigenvalues = np.linalg.eigvalsh(gram)
    if not eigenvalues[0] > 0 or eigenvalues[-1] / eigenvalues[0] > MAX_CONDITION**2:
        note = "no row weights: the rows' gradients are (nearly) linearly dependent, e.g. rows"
        return dataclasses.replace(report, note=_joined(report.note, note + " that repeat"))
    fitted = np.linalg.solve(gram, to_updates.T).T  # [updates, rows with items]
    unexplained = norms**2 - np.sum(to_updates * fitted, axis=1)
    residuals = np.sqrt(np.maximum(unexplained, 0.0)) / np.where(norms > 0, norms, 1.0)
    weights = np.full((len(cut_updates), report.row_items.size), np.nan)
    weights[:, rows[:, 0]] = fitted[1:] / fitted[0]
    note = report.note
    if np.any(residuals > RESIDUAL_RTOL):
        note = _joined(note, f"a residual above {RESIDUAL_RTOL:.0e}: that update is not a"
                       " reweighting of the rows' gradients (e.g. a term the rows' gradients do"
                       " not hold, or a loop run in bfloat16 or float16, whose rounding moves"
                       " every update about that much: run it in float32); its weights are the"
                       " closest fit")  # fmt: skip
    return dataclasses.replace(report, weights=weights, residuals=residuals, note=note)


def _equal_rows(report: InvarianceReport) -> str:
    """Rows of equal items: each cut's micro-batches hold as many, so a normalization per
    micro-batch or per device by them cannot show ("" where the items differ)."""
    items = report.row_items
    if items.size < 2 or np.any(items != items[0]):
        return ""
    return (
        f"every row holds {items[0]:g} items: a loop that normalizes per micro-batch or per"
        " device by them gives every cut the same update on these rows (a mean of means is"
        " then the mean); rows whose items differ tell it (unless every row always holds as"
        " many, as a GRPO group holds its G completions)"
    )


def _joined(*notes: str) -> str:
    return "\n".join(note for note in notes if note)


def _clip_note(report: InvarianceReport) -> str:
    """What the one-batch run did with the ``max_grad_norm`` you passed ("" if none)."""
    norm, threshold = report.one_batch_norm, report.max_grad_norm
    if threshold is None:
        return ""
    said = f"the one-batch run applied a gradient of norm {norm:#.4g}"
    if abs(norm - threshold) <= CLIP_RTOL * threshold:
        return (
            f"{said}, the max_grad_norm you passed: the whole batch clipped to it, the reference"
            " every cut is compared with"
        )
    if norm < threshold:
        return (
            f"{said}, below the max_grad_norm you passed ({threshold:g}): no clip bites at these"
            " parameters (pass a smaller one to test the clipping)"
        )
    return f"{said}, above the max_grad_norm you passed ({threshold:g}): it did not clip"


def _distance(a: Leaves, b: Leaves) -> float:
    """``|a - b|`` over every leaf, in float64."""
    return math.sqrt(math.fsum(float(np.sum(np.square(x - y))) for x, y in zip(a, b, strict=True)))
