"""What weights that no known form explains most likely mean: the audit report's hints.

An ``unknown`` verdict, or a reading that two stories fit alike (a clip of the window,
or every item weighed less), gets a note that names the likely causes from the
fitted weights: cells that weigh nothing, a known form off by one factor, a
residual (no reweighting at all).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from bigbatch._clipping import scaled_error
from bigbatch._forms import CLIPPED_PER_MICRO_BATCH, EXACT, form_weights

if TYPE_CHECKING:
    from bigbatch._report import AuditReport

DIVISOR_OFF = (
    "a divisor or a count off by that factor (a count kept from an earlier window: the audit"
    " runs your loop on a window of other items first; a sum over devices taken twice, a mean"
    " over devices or micro-batches taken on top of the window's N or left out, a loss scale"
    " not undone, a learning rate scaled)"
)


def cell_name(report: AuditReport, r: int, m: int) -> str:
    """``micro-batch m``, ``device r, micro-batch m``, or ``device r`` if its cells weigh alike."""
    if report.num_devices == 1:
        return f"micro-batch {m}"
    device = report.weights[r][~np.isnan(report.weights[r])]
    if device.size > 1 and np.ptp(device) <= report.weight_tolerance * np.max(np.abs(device)):
        return f"device {r}"
    return f"device {r}, micro-batch {m}"


def unknown_because(report: AuditReport) -> str:
    """What an ``unknown`` verdict most likely means, from the fit's numbers."""
    if not report.finite:
        empty = ", ".join(cell_name(report, r, m) for r, m in report.empty_cells) or "none"
        return (
            "the update has NaN or inf: a division by the items of a cell without any? (cells"
            f" without items: {empty}); with rows that all have items the weights can be fitted"
        )
    if report.residual > report.residual_tolerance:
        return _no_reweighting(report)
    if not report.moved:
        return "no update: an accumulator still waiting for micro-batches gives none"
    dropped = _dropped_cells(report)
    if dropped:
        return f"{dropped} weighed 0: a gradient that never reached the update ({_why_dropped(report)})"
    scaled = scaled_forms(report)
    if scaled:
        name, scale = scaled[0]
        weights = "the big batch's" if name == EXACT else f"{name}'s"
        clip = ", or a clip of the window you did not tell the audit of (max_grad_norm=)"
        causes = divisor_off(report, scale) + clip * (scale < 1)
        return f"{weights} weights times {scale:.4g}: {causes}"
    closest = min(report.form_errors, key=report.form_errors.get)
    return (
        f"a reweighting, but of no known form (closest: {closest}, off by"
        f" {report.form_errors[closest]:.1%}): e.g. a clip inside the micro-batch loop"
        " (clip_grad_norm_, optax.clip_by_global_norm before the accumulation: it clips the"
        " running sum, so the earlier micro-batches weigh less), each device's micro-batch"
        " clipped by its own norm, or a loss other than the reference one"
    )


def _no_reweighting(report: AuditReport) -> str:
    """The causes of a residual: the update is not ``-lr`` times a sum of the cells' gradients."""
    devices = (
        "; or a loop over several devices audited as one (give the audit their count:"
        " num_devices= in JAX, world_size= in PyTorch)"
        if report.num_devices == 1
        else ""
    )
    return (
        "a loss in other units than the reference (a mean per sequence or per row where the"
        " reference sums the items), a different optimizer than the `optimizer` handed to your"
        " code (e.g. Adam), weight decay, clipping or normalizing elementwise, noise"
        f"{devices}; the weights above are only the closest fit"
    )


def _zero_weights(report: AuditReport) -> np.ndarray:
    """``[R, k]``: the cells with items that weigh 0 (an empty cell weighs nothing to fit)."""
    return np.abs(np.nan_to_num(report.weights, nan=1.0)) <= report.weight_tolerance


def _dropped_cells(report: AuditReport) -> str:
    """The cells with items that the update left out (weight 0), named: whole devices and
    micro-batches first, then single cells; "" if none."""
    zero = _zero_weights(report)
    left_out = zero | (report.items == 0)
    devices = [r for r in range(zero.shape[0]) if zero[r].any() and left_out[r].all()]
    devices = devices if report.num_devices > 1 else []
    whole = [m for m in range(zero.shape[1]) if zero[:, m].any() and left_out[:, m].all()]
    names = []
    if devices:
        names.append(f"device{'s' * (len(devices) > 1)} {', '.join(map(str, devices))}")
    if whole:
        every = " on every device" if report.num_devices > 1 else ""
        names.append(f"micro-batch{'es' * (len(whole) > 1)} {', '.join(map(str, whole))}{every}")
    cells = [(r, m) for r, m in np.argwhere(zero) if m not in whole and r not in devices]
    names += list(dict.fromkeys(cell_name(report, int(r), int(m)) for r, m in cells))
    return "; ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _why_dropped(report: AuditReport) -> str:
    """The likely causes of cells that weigh 0."""
    zero = _zero_weights(report)
    if report.num_devices > 1 and any(zero[r].all() for r in range(zero.shape[0])):
        return "a device's gradient left out of the all-reduce: a psum or a DDP sync missing"
    return (
        "a zero_grad or a reset of the sums inside the window, a gradient assigned where it"
        " should be added, a window closed early"
    )


def scaled_forms(report: AuditReport) -> list[tuple[str, float]]:
    """The known forms whose weights times one factor are the fitted ones, with the factor."""
    found = []
    for name in report.form_errors:
        if name == CLIPPED_PER_MICRO_BATCH:
            continue
        expected = form_weights(name, report.items, k=report.k, first_labels=report.first_labels)
        if np.any(np.isfinite(expected) & np.isfinite(report.weights)):
            scale, error = scaled_error(report.weights, expected)
            if error <= report.weight_tolerance:
                found.append((name, scale))
    return found


def divisor_off(report: AuditReport, scale: float) -> str:
    """The causes of weights off by one factor, ``scale``: first the short window's own,
    when there is one (:func:`tail_factor`)."""
    own = tail_factor(report, scale) or device_factor(report, scale)
    return f"{own}; or {DIVISOR_OFF}" if own else DIVISOR_OFF


def device_factor(report: AuditReport, scale: float) -> str:
    """On ``R`` devices, a factor ``R``: gradients summed over the devices twice (under
    ``shard_map``, autodiff of replicated parameters sums them already); else ``""``."""
    devices = report.num_devices
    if devices > 1 and abs(scale / devices - 1) <= report.weight_tolerance:
        return (
            f"that factor is the number of devices, {devices}: the gradient summed over them"
            " twice (an all-reduce on top of one already made: under jax.shard_map, jax.grad"
            " with respect to replicated parameters sums over the devices itself; in PyTorch,"
            " DDP averages, so a sum of your own on top counts each rank again)"
        )
    return ""


def tail_factor(report: AuditReport, scale: float) -> str:
    """In a short window of ``k_tail`` micro-batches, a factor ``k_tail / k``: the tail
    divided by the nominal ``k`` (``docs/math.md`` section 6); else ``""``."""
    k_window = report.items.shape[1]
    if k_window < report.k and abs(scale * report.k / k_window - 1) <= report.weight_tolerance:
        return (
            f"that factor is k_tail / k = {k_window} / {report.k}: the short window divided by"
            f" the nominal k where it holds {k_window} micro-batches (a constant"
            " gradient_accumulation_steps, as nanoGPT's loop divides by)"
        )
    return ""


def other_readings(report: AuditReport) -> list[str]:
    """For a window read as clipped once: the forms whose weights, times a factor above 1, are
    the same weights (no clip then, but a divisor off): the window cannot tell them apart."""
    if not report.clipped_once:
        return []
    return [
        f"the same weights are {'the big batch' if name == EXACT else name}'s times"
        f" {scale:.4g}: no clip then, but {divisor_off(report, scale)}"
        for name, scale in scaled_forms(report)
        if scale > 1 + report.weight_tolerance
    ]
