"""The audit report as a person reads it: the headline, the table of cells and the notes."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from bigbatch._forms import (
    CLIPPED_PER_MICRO_BATCH,
    EXACT,
    FIXES,
    UNKNOWN,
    WHAT_IT_DOES,
    form_weights,
)
from bigbatch._report_hints import (
    cell_name,
    divisor_off,
    other_readings,
    tail_factor,
    unknown_because,
)
from bigbatch._tolerances import WEIGHT_RTOL

if TYPE_CHECKING:
    from bigbatch._report import AuditReport


ZERO_WEIGHT = 1e-6
"""A weight below this reads ``0x``: float32 rounding of the fit (a cell dropped by a
``zero_grad`` inside the window fits at ``-3.7e-08x``; real weights are not that small)."""


def _times(weight: float) -> str:
    """``12.3456 -> '12.3x'``: a weight as a multiple of the big batch's (``0x`` below
    `ZERO_WEIGHT`)."""
    if np.isnan(weight):
        return "-"
    return "0x" if abs(weight) < ZERO_WEIGHT else f"{weight:#.3g}x"


def _uniform_weight(report: AuditReport) -> float | None:
    """The one weight every item of the window has (within the tolerance), or None."""
    w = report.weights[np.isfinite(report.weights)]
    if w.size and np.ptp(w) <= report.weight_tolerance * np.max(np.abs(w)):
        return float(np.mean(w))
    return None


def _extremes(report: AuditReport) -> list[tuple[int, int]]:
    """The cells whose weights are farthest above and below the big batch's."""
    w = report.weights
    cells = [(r, m) for r in range(w.shape[0]) for m in range(w.shape[1]) if not np.isnan(w[r, m])]
    high = max(cells, key=lambda c: w[c])
    low = min(cells, key=lambda c: w[c])
    found = [c for c in (high, low) if abs(w[c] - 1.0) > report.weight_tolerance]
    return list(dict.fromkeys(found))  # one cell when high and low are the same


def _threshold(report: AuditReport) -> str:
    """``= the max_grad_norm you passed``, ``not the max_grad_norm 1 you passed``, or what to
    pass to tell a clip from a uniform scale."""
    if report.max_grad_norm is None:
        if not report.clipped_once:  # a clip per micro-batch is a form of its own
            return ""
        tail = tail_factor(report, report.clip_scale)
        weighed = f"every item weighed {report.clip_scale:.4g}x" + (f" ({tail})" if tail else "")
        return (
            f"or {weighed}: pass max_grad_norm= your clip threshold, or math.inf if your loop"
            " does not clip, to tell"
        )
    if report.clip_kept is None:
        return ""
    if report.clip_kept:
        return "= the max_grad_norm you passed"
    if math.isinf(report.max_grad_norm):
        return "but you said it does not clip (max_grad_norm=inf): every item weighed less"
    return f"not the max_grad_norm {report.max_grad_norm:g} you passed"


LOW_PRECISION_RESIDUAL = (
    ", or, if your loop computes in bfloat16, its rounding (a residual of a few 1e-3: run the"
    " audit in float32, without autocast; the weighting is the same code)"
)


def headline(report: AuditReport) -> str:
    """The sentence a person reads first."""
    if not report.finite:
        return "your update is not finite (NaN or inf): nothing to fit"
    if not report.moved:
        return "your loop did not change the parameters (did its window close?)"
    if report.residual > report.residual_tolerance:
        return _not_a_reweighting(report)
    if report.verdict == EXACT and report.clipped_once:
        said = _threshold(report)
        if report.clip_kept is False and math.isfinite(report.max_grad_norm):
            causes = divisor_off(report, report.clip_scale)
            said += f"; or every item weighed {report.clip_scale:.4g}x: {causes}"
        return (
            f"your loop is the big batch clipped once per window to c ="
            f" {report.clipped_to:#.4g}" + (f" ({said})" if said else "")
        )
    if report.verdict == EXACT:
        unclipped = "" if report.clip_kept is not False else ", but it does not clip it"
        unchecked = " and ".join(report.unchecked)
        if unchecked:
            them = "them" if len(report.unchecked) > 1 else "it"
            unclipped += (
                f"; {unchecked} held no item: a loop that drops {them} would read the same"
                " (audit rows with fewer empty ones)"
            )
        return (
            f"your loop weighs every item like the big batch (within"
            f" {report.max_weight_error:.1e}){unclipped}"
        )
    uniform = _uniform_weight(report)
    if uniform is not None:
        return f"your loop weighs every item at {_times(uniform)} the big batch"
    said = [
        f"{cell_name(report, r, m)} at {_times(float(report.weights[r, m]))}"
        for r, m in _extremes(report)
    ]
    if not said:  # every cell within the tolerance of the big batch, the fit aside
        return f"your loop weighs every item within {report.max_weight_error:.1e} of the big batch"
    return f"your loop weighs an item of {said[0]} the big batch" + "".join(
        f", one of {other}" for other in said[1:]
    )


def _not_a_reweighting(report: AuditReport) -> str:
    """The headline of an update that is no reweighting of the cells' gradients: within the
    parameters' rounding (it can explain the residual), or another kind of update."""
    # the readback's noise is about update_rounding of the update: from a tenth of the
    # residual up, it can be the residual (0.55 against 0.02 where a GradScaler's clip came
    # before unscale_), and "not plain SGD" would send the user the wrong way
    if report.update_rounding > 0.1 * report.residual:
        return (
            f"your update is within the parameters' rounding ({report.update_rounding:.1e} of"
            f" it; residual {report.residual:.1e}), too small to read back: a loss scale not"
            " undone (GradScaler: scaler.unscale_(optimizer) before clipping), or a learning"
            " rate too small for the audit (learning_rate=)"
        )
    rounding = LOW_PRECISION_RESIDUAL if report.residual < 10 * report.residual_tolerance else ""
    return (
        f"your update is not a reweighting of the micro-batches' gradients (residual"
        f" {report.residual:.1e}): not plain SGD on an accumulated gradient{rounding}"
    )


def content(report: AuditReport) -> tuple[str, list[list[str]], list[str], list[str]]:
    """The header line, the table (first row: the column names), a remark per row, the notes."""
    devices = f"{report.num_devices} device" + ("s" if report.num_devices > 1 else "")
    window = f"{report.k_window} micro-batches x {devices}, {report.items.sum():g} items"
    if report.short_window:
        window += f", a short window (k = {report.k})"
    header = f"Audit of one accumulated SGD update ({window}): {report.summary()}"
    expected = report.verdict_weights
    if report.verdict in (EXACT, UNKNOWN) and not report.clipped_once:
        expected = None  # the big batch's column says it
    column = report.verdict + (", clipped" if report.clipped_once else "")
    table = [
        ["device", "micro-batch", "items", "your weight", "big batch"]
        + [column] * (expected is not None)
    ]
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


def _micro_batch_clip_notes(report: AuditReport, threshold: str) -> list[str]:
    """Which micro-batches ``clipped_per_micro_batch`` cut, to what, and its base form."""
    weights = report.verdict_weights
    base = form_weights(
        report.clip_base or EXACT, report.items, k=report.k, first_labels=report.first_labels
    )
    below = weights < (1 - WEIGHT_RTOL) * base  # a clipped cell weighs less than its base's
    cut = [m for m in range(report.k_window) if np.any(below[:, m])]
    whole = len(cut) < report.k_window
    base = report.clip_base
    notes = [
        f"micro-batches {', '.join(map(str, cut))} clipped to c = {report.clipped_to:#.4g}"
        f" each (the norm of its share of the gradient{threshold})"
        + ("; the others, below c, added whole" if whole else "")
    ]
    if _summed_clipped(report):
        notes.append(
            "c N is the max_grad_norm you passed: each micro-batch's SUMMED gradient was"
            " clipped to it, before the division by the window's N"
        )
    if base != EXACT:
        notes.append(f"before the clip, a {base}: {WHAT_IT_DOES[base]}; fix: {FIXES[base]}")
    return notes


def _summed_clipped(report: AuditReport) -> bool:
    """``c N`` is the max_grad_norm you passed, where the clip was not at it: the SUMMED
    gradient was clipped, before the division by the window's ``N``."""
    summed = report.clipped_to * report.items.sum()
    return report.clip_kept is False and abs(summed - report.max_grad_norm) <= (
        report.clip_tolerance * report.max_grad_norm
    )


def _window_clip_caveats(report: AuditReport) -> list[str]:
    """What a window clipped once hides: the summed gradient clipped before the division
    (``c N`` the threshold passed), and any constant factor the clip erased."""
    if _summed_clipped(report):
        return [
            "c N is the max_grad_norm you passed: the SUMMED gradient was clipped, before"
            " the division by the window's N (clip the window's gradient after it)"
        ]
    if report.clip_kept:
        return [
            "the clip sets the update's norm whatever the gradient's scale: a constant factor"
            " before it (a count off, a loss scale not undone) cannot show here; audit once"
            f" more with a max_grad_norm above |g| = {report.grad_norm:#.4g} in your loop and"
            " here to see it"
        ]
    return []


def _clip_notes(report: AuditReport) -> list[str]:
    """What the audit saw of clipping, and of the ``max_grad_norm`` you passed."""
    said = _threshold(report)
    threshold = f", {said}" if said else ""
    if report.clipped_once:
        return [
            f"clipped once per window: every weight is {report.verdict}'s times"
            f" {report.clip_scale:.4g} = c / |g|, c = {report.clipped_to:#.4g} (the norm of the"
            f" applied gradient{threshold}), |g| = {report.grad_norm:#.4g} before the clip",
            *_window_clip_caveats(report),
        ]
    if report.verdict == CLIPPED_PER_MICRO_BATCH:
        return _micro_batch_clip_notes(report, threshold)
    if report.verdict == UNKNOWN or report.max_grad_norm is None:
        return []
    if math.isinf(report.max_grad_norm):  # "your loop does not clip": nothing to compare
        return [f"the window's gradient norm |g| = {report.grad_norm:#.4g}, not clipped"]
    side = "below" if report.grad_norm <= report.max_grad_norm else "above"
    effect = "no clip at these parameters" if report.clip_kept else "yet it was not clipped"
    return [
        f"the window's gradient norm |g| = {report.grad_norm:#.4g} is {side} the max_grad_norm"
        f" you passed ({report.max_grad_norm:g}): {effect}"
    ]


def _notes(report: AuditReport) -> list[str]:
    verdict = f"verdict: {report.verdict}: {WHAT_IT_DOES.get(report.verdict, '')}"
    if report.verdict == UNKNOWN:
        verdict = f"verdict: unknown: {unknown_because(report)}"
    match = " (match, clipped)" if report.clipped_once else " (match)"
    forms = " | ".join(
        f"{name} {error:.1e}" + (match if name in report.matches else "")
        for name, error in report.form_errors.items()
    )
    notes = [verdict, *_clip_notes(report), *other_readings(report)]
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
