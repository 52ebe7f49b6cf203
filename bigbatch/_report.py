"""The audit's answer: how a loop weighs each cell, the verdict, and a table a person reads."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from bigbatch._forms import EXACT, UNKNOWN
from bigbatch._layout import WindowShape
from bigbatch._report_text import content, headline
from bigbatch._tolerances import CLIP_RTOL

__all__ = ["UNKNOWN", "AuditReport"]

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
        (``bigbatch.BUG_NAMES``, ``bigbatch.CLIP_FORMS``), or ``"unknown"``; a
        window clipped once keeps its form's name (``clip_scale < 1``).
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
      update_rounding: the same against your loop's own update: near 1 or
        above, the update is lost in the parameters' rounding.
      left_out_rows: batch rows that were in no cell.
      first_labels: ``[num_devices, k_window]`` rows of each cell whose label at
        position 0 is set, or None (the rows' labels were not known).
      verdict_weights: ``[num_devices, k_window]``, the verdict's weights as they
        matched (its form's, times ``clip_scale``), or None for ``"unknown"``.
      clip_scale: ``s``: the weights are the verdict form's times ``s``; below 1
        the window was clipped once, to ``clipped_to = s * grad_norm``.
      clipped_to: the norm the loop clipped to: the applied gradient's (clipped
        once per window), or each clipped micro-batch's share of it
        (``clipped_per_micro_batch``); None when nothing was clipped.
      grad_norm: the window gradient's norm before a clip of the window:
        ``|delta| / lr / clip_scale``.
      max_grad_norm: the threshold you passed the audit, or None.
      clip_tolerance: the largest relative difference between ``clipped_to`` (or
        an unclipped ``grad_norm`` below it) and ``max_grad_norm`` that counts as
        equal (``CLIP_RTOL``).
      clip_base: ``clipped_per_micro_batch`` only: the form each micro-batch is
        weighed by before its clip (``"exact"``: its share of the big batch).
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
    update_rounding: float = 0.0
    left_out_rows: int = 0
    first_labels: np.ndarray | None = None
    verdict_weights: np.ndarray | None = None
    clip_scale: float = 1.0
    clipped_to: float | None = None
    grad_norm: float = math.nan
    max_grad_norm: float | None = None
    clip_tolerance: float = CLIP_RTOL
    clip_base: str | None = None

    @property
    def passed(self) -> bool:
        """Whether the loop is the big-batch update (``verdict == "exact"``), clipped once to
        the ``max_grad_norm`` you passed where the window's norm is above it, or not clipped.

        A window scaled by one factor ``s < 1`` reads ``exact``, clipped once, but passes
        only with the threshold passed to the audit: without it a clip cannot be told from
        a bug that weighs every item ``s`` times too little (a loss divided by ``k``
        twice). ``max_grad_norm=math.inf`` says the loop does not clip at all.
        """
        return self.verdict == EXACT and self.clip_kept is not False and not self.unconfirmed

    @property
    def unconfirmed(self) -> bool:
        """``exact``, but the audit cannot rule out a bug (``summary`` says NOT CONFIRMED):
        clipped once with no ``max_grad_norm`` passed (a clip or a uniform scale error), or a
        whole micro-batch or device without items (a loop that drops it reads the same)."""
        clip_or_scale = self.clipped_once and self.max_grad_norm is None
        return self.verdict == EXACT and (clip_or_scale or bool(self.unchecked))

    @property
    def unchecked(self) -> list[str]:
        """The micro-batches (on every device) and the devices (in every micro-batch) without
        items: their weight is unknown, so a loop that drops them cannot be told."""
        num_devices, k_window = self.items.shape
        empty = self.items == 0
        micro_batches = [f"micro-batch {m}" for m in range(k_window) if empty[:, m].all()]
        devices = [f"device {r}" for r in range(num_devices) if empty[r].all()]
        return (micro_batches if k_window > 1 else []) + (devices if num_devices > 1 else [])

    @property
    def clipped_once(self) -> bool:
        """Whether the window's gradient was clipped once, as a whole (``clip_scale < 1``)."""
        return self.clip_scale < 1.0

    @property
    def clip_kept(self) -> bool | None:
        """Whether the loop clips to the ``max_grad_norm`` you passed (None: none passed, or
        ``unknown``): the applied norm is ``min(grad_norm, max_grad_norm)``, or (clipped per
        micro-batch) each clipped share's norm is ``max_grad_norm`` (``clip_tolerance``)."""
        if self.max_grad_norm is None or self.verdict == UNKNOWN:
            return None
        if self.clipped_to is not None and not self.clipped_once:  # per micro-batch
            expected, actual = self.max_grad_norm, self.clipped_to
        else:
            expected = min(self.grad_norm, self.max_grad_norm)
            actual = self.grad_norm * self.clip_scale
        if math.isinf(expected):  # max_grad_norm=inf, yet clipped per micro-batch
            return False
        return bool(abs(actual - expected) <= self.clip_tolerance * expected)

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
        status = "PASSED" if self.passed else "NOT CONFIRMED" if self.unconfirmed else "FAILED"
        return f"{status}, {self.verdict}: {headline(self)}"

    def __repr__(self) -> str:
        text = f"AuditReport({self.summary()}; print(report) for the table)"
        if len(text) > _REPR_LIMIT:
            text = f"AuditReport({self.summary()})"
        if len(text) > _REPR_LIMIT:
            text = text[: _REPR_LIMIT - 4] + "...)"
        return text

    def __str__(self) -> str:
        header, table, remarks, notes = content(self)
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = [header, ""]
        for row, remark in zip(table, remarks, strict=True):
            cells = [cell.rjust(width) for cell, width in zip(row, widths, strict=True)]
            lines.append(("  " + "  ".join(cells) + "  " + remark).rstrip())
        return "\n".join(lines + [""] + notes)

    def to_markdown(self) -> str:
        """The report as Markdown: the summary, the table of cells and the notes."""
        header, table, remarks, notes = content(self)
        align = ["---:"] * len(table[0])
        if any(remarks):
            table = [row + [remark] for row, remark in zip(table, ["", *remarks[1:]], strict=True)]
            align.append("---")
        rows = ["| " + " | ".join(row) + " |" for row in table]
        lines = [f"**{header}**", "", rows[0], "|" + "|".join(align) + "|", *rows[1:], ""]
        return "\n".join(lines + [f"- {note}" for note in notes])
