"""The audit's answer: how a loop weighs each cell, the verdict, and a table a person reads."""

from __future__ import annotations

import dataclasses

import numpy as np

from bigbatch._forms import EXACT, FIXES, WHAT_IT_DOES, form_weights
from bigbatch._layout import WindowShape

UNKNOWN = "unknown"

_REPR_LIMIT = 240  # pytest shows at most this much of an assertion message's repr


@dataclasses.dataclass(frozen=True, eq=False)
class AuditReport(WindowShape):
    """How one accumulated SGD update weighs the items of each cell of its window.

    A cell is one micro-batch on one device. The update is fitted as
    ``-lr * sum_c w_c G_c`` (``G_c`` the gradient of cell ``c``'s summed loss),
    and ``weights`` are the ``w_c`` in units of the big batch's ``1/N``: all 1
    for a loop that is the big-batch update. ``assert report.passed, report``
    fails with a one-line summary; ``print(report)`` shows the whole table.

    Example:
      >>> import numpy as np, bigbatch
      >>> layout = bigbatch.layout_rows(np.array([3.0, 1.0]), k=2, num_devices=1)
      >>> grads = [np.array([1.0, 0.0]), np.array([0.0, 3.0])]  # the 2 cells' gradients
      >>> update = -(grads[0] + grads[1]) / 4  # the big batch's: every item weighs 1/4
      >>> products = bigbatch.cell_products(lambda r, m: [grads[m]], [update], layout,
      ...                                   learning_rate=1.0, progress=False)
      >>> report = bigbatch.audit_update(products, layout, learning_rate=1.0)
      >>> report.passed, report.summary()
      (True, 'PASSED, exact: your loop weighs every item like the big batch (within 0.0e+00)')

    Attributes:
      verdict: ``"exact"``, the name of the known bug whose weights these are
        (``bigbatch.BUG_NAMES``), or ``"unknown"``.
      weights: float64 ``[num_devices, k_window]``, each cell's weight as a
        multiple of ``1/N``; NaN for a cell without items (its gradient is
        zero: it is left out of the fit).
      items: float64 ``[num_devices, k_window]``, the items of each cell.
      residual: ``|y - G w| / |y|`` for the update ``y`` (as a gradient): 0 for
        a reweighting of the cells' gradients, float32 rounding (~1e-6) in
        practice; large for anything else.
      scale: the total weight of the window's items, ``sum_c n_c w_c``: 1 for
        the big batch (``1/R`` for a forgotten DDP average).
      max_weight_error: the largest ``|weight - 1|`` over cells with items: how
        far the worst item is from the big batch's weight, relatively.
      update_error: ``|update - big-batch update| / |big-batch update|``, no
        fit involved.
      form_errors: for each form the window can tell apart, the largest
        relative error of ``weights`` against that form's weights.
      matches: every form within ``weight_tolerance`` (forms that weigh this
        window alike are all listed; ``verdict`` is the first).
      k: the nominal micro-batches per window (``k_window < k`` in a short
        window).
      condition: the condition number of the cells' gradients (how much the
        fit can amplify rounding).
      residual_tolerance: the largest ``residual`` of a reweighting.
      weight_tolerance: the largest relative weight error of a match.
      rounding: the relative rounding of the parameters' dtype against the
        big-batch update (the noise in reading the update back).
      left_out_rows: batch rows that were in no cell.
      first_labels: ``[num_devices, k_window]`` rows of each cell whose label at
        position 0 is set, or None (the rows' labels were not known).
    """

    verdict: str
    weights: np.ndarray
    items: np.ndarray
    residual: float
    scale: float
    max_weight_error: float
    update_error: float
    form_errors: dict[str, float]
    matches: tuple[str, ...]
    k: int
    condition: float
    residual_tolerance: float
    weight_tolerance: float
    rounding: float = 0.0
    left_out_rows: int = 0
    first_labels: np.ndarray | None = None

    @property
    def passed(self) -> bool:
        """Whether the loop is the big-batch update (``verdict == "exact"``)."""
        return self.verdict == EXACT

    @property
    def finite(self) -> bool:
        """Whether the loop's update was finite (no NaN or inf: there was something to fit)."""
        return bool(np.isfinite(self.residual))

    @property
    def moved(self) -> bool:
        """Whether the loop changed the parameters at all."""
        return self.finite and bool(np.any(np.nan_to_num(self.weights) != 0))

    @property
    def empty_cells(self) -> list[tuple[int, int]]:
        """The cells ``(device, micro-batch)`` without items (left out of the fit)."""
        return [tuple(int(i) for i in cell) for cell in np.argwhere(self.items == 0)]

    def summary(self) -> str:
        """One line: passed or not, the verdict, and the worst-weighed cell."""
        status = "PASSED" if self.passed else "FAILED"
        return f"{status}, {self.verdict}: {_headline(self)}"

    def __repr__(self) -> str:
        text = f"AuditReport({self.summary()}; print(report) for the table)"
        if len(text) > _REPR_LIMIT:
            text = f"AuditReport({self.summary()})"
        if len(text) > _REPR_LIMIT:
            text = text[: _REPR_LIMIT - 4] + "...)"
        return text

    def __str__(self) -> str:
        header, table, remarks, notes = _content(self)
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = [header, ""]
        for row, remark in zip(table, remarks, strict=True):
            cells = [cell.rjust(width) for cell, width in zip(row, widths, strict=True)]
            lines.append(("  " + "  ".join(cells) + "  " + remark).rstrip())
        return "\n".join(lines + [""] + notes)

    def to_markdown(self) -> str:
        """The report as Markdown: the summary, the table of cells and the notes."""
        header, table, remarks, notes = _content(self)
        align = ["---:"] * len(table[0])
        if any(remarks):
            table = [row + [remark] for row, remark in zip(table, ["", *remarks[1:]], strict=True)]
            align.append("---")
        rows = ["| " + " | ".join(row) + " |" for row in table]
        lines = [f"**{header}**", "", rows[0], "|" + "|".join(align) + "|", *rows[1:], ""]
        return "\n".join(lines + [f"- {note}" for note in notes])


def _times(weight: float) -> str:
    """``12.3456 -> '12.3x'``: a weight as a multiple of the big batch's."""
    return "-" if np.isnan(weight) else f"{weight:#.3g}x"


def _cell_name(report: AuditReport, r: int, m: int) -> str:
    """``micro-batch m``, ``device r, micro-batch m``, or ``device r`` if its cells weigh alike."""
    if report.num_devices == 1:
        return f"micro-batch {m}"
    device = report.weights[r][~np.isnan(report.weights[r])]
    if device.size > 1 and np.ptp(device) <= report.weight_tolerance * np.max(np.abs(device)):
        return f"device {r}"
    return f"device {r}, micro-batch {m}"


def _extremes(report: AuditReport) -> list[tuple[int, int]]:
    """The cells whose weights are farthest above and below the big batch's."""
    w = report.weights
    cells = [(r, m) for r in range(w.shape[0]) for m in range(w.shape[1]) if not np.isnan(w[r, m])]
    high = max(cells, key=lambda c: w[c])
    low = min(cells, key=lambda c: w[c])
    found = [c for c in (high, low) if abs(w[c] - 1.0) > report.weight_tolerance]
    return list(dict.fromkeys(found))  # one cell when high and low are the same


def _headline(report: AuditReport) -> str:
    """The sentence a person reads first."""
    w = report.weights[~np.isnan(report.weights)]
    if not report.finite:
        return "your update is not finite (NaN or inf): nothing to fit"
    if not report.moved:
        return "your loop did not change the parameters (did its window close?)"
    if report.residual > report.residual_tolerance:
        return (
            f"your update is not a reweighting of the micro-batches' gradients (residual"
            f" {report.residual:.1e}): not plain SGD on an accumulated gradient"
        )
    if report.passed:
        return (
            f"your loop weighs every item like the big batch (within {report.max_weight_error:.1e})"
        )
    if np.ptp(w) <= report.weight_tolerance * np.max(np.abs(w)):
        return f"your loop weighs every item at {_times(float(w[0]))} the big batch"
    said = [
        f"{_cell_name(report, r, m)} at {_times(float(report.weights[r, m]))}"
        for r, m in _extremes(report)
    ]
    if not said:  # every cell within the tolerance of the big batch, the fit aside
        return f"your loop weighs every item within {report.max_weight_error:.1e} of the big batch"
    return f"your loop weighs an item of {said[0]} the big batch" + "".join(
        f", one of {other}" for other in said[1:]
    )


def _content(report: AuditReport) -> tuple[str, list[list[str]], list[str], list[str]]:
    """The header line, the table (first row: the column names), a remark per row, the notes."""
    devices = f"{report.num_devices} device" + ("s" if report.num_devices > 1 else "")
    window = f"{report.k_window} micro-batches x {devices}, {report.items.sum():g} items"
    if report.short_window:
        window += f", a short window (k = {report.k})"
    header = f"Audit of one accumulated SGD update ({window}): {report.summary()}"
    bug = report.verdict if report.verdict not in (EXACT, UNKNOWN) else None
    expected = None
    if bug:
        expected = form_weights(bug, report.items, k=report.k, first_labels=report.first_labels)
    table = [["device", "micro-batch", "items", "your weight", "big batch"] + [bug] * bool(bug)]
    remarks = [""]
    for r in range(report.num_devices):
        for m in range(report.k_window):
            empty = report.items[r, m] == 0
            row = [str(r), str(m), f"{report.items[r, m]:g}", _times(report.weights[r, m])]
            row.append("-" if empty else _times(1.0))
            if expected is not None:
                row.append(_times(expected[r, m]))
            table.append(row)
            remarks.append("no item: zero gradient, left out of the fit" if empty else "")
    return header, table, remarks, _notes(report)


def _unknown_because(report: AuditReport) -> str:
    """What an ``unknown`` verdict most likely means, from the fit's numbers."""
    if not report.finite:
        empty = ", ".join(_cell_name(report, r, m) for r, m in report.empty_cells) or "none"
        return (
            "the update has NaN or inf: a division by the items of a cell without any? (cells"
            f" without items: {empty}); with rows that all have items the weights can be fitted"
        )
    if report.residual > report.residual_tolerance:
        return (
            "a different optimizer than the `optimizer` handed to your code (e.g. Adam),"
            " clipping or normalizing elementwise, weight decay, noise; the weights above"
            " are only the closest fit"
        )
    if not report.moved:
        return "no update: an accumulator still waiting for micro-batches gives none"
    closest = min(report.form_errors, key=report.form_errors.get)
    return (
        f"a reweighting, but of no known form (closest: {closest}, off by"
        f" {report.form_errors[closest]:.1%}): e.g. each micro-batch clipped by its norm, or a"
        " loss other than the reference one"
    )


def _notes(report: AuditReport) -> list[str]:
    verdict = f"verdict: {report.verdict}: {WHAT_IT_DOES.get(report.verdict, '')}"
    if report.verdict == UNKNOWN:
        verdict = f"verdict: unknown: {_unknown_because(report)}"
    forms = " | ".join(
        f"{name} {error:.1e}" + (" (match)" if name in report.matches else "")
        for name, error in report.form_errors.items()
    )
    notes = [verdict]
    if len(report.matches) > 1:
        others = ", ".join(report.matches[1:])
        notes.append(
            f"this window weighs {report.verdict} and {others} alike: it cannot tell them apart"
        )
    if report.verdict not in (EXACT, UNKNOWN):
        notes.append(f"fix: {FIXES[report.verdict]}")
    reweighting = "yes" if report.residual <= report.residual_tolerance else "no"
    notes += [
        f"a reweighting of the cells' gradients: {reweighting} (residual {report.residual:.1e};"
        f" at most {report.residual_tolerance:.0e} for one)",
        f"total weight of the window's items: {report.scale:.4f} (the big batch: 1)",
        f"distance to the big-batch update: {report.update_error:.1e} (relative)",
        f"known forms, largest relative weight error (a match: at most"
        f" {report.weight_tolerance:.0e}): {forms}",
        "weights are multiples of the big batch's 1/N"
        + ("; device r holds rows [r*p, (r+1)*p) of each micro-batch" * (report.num_devices > 1)),
    ]
    if report.left_out_rows:
        notes.append(f"{report.left_out_rows} batch rows were in no cell (not a multiple of cells)")
    return notes
