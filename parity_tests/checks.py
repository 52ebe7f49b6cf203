"""One comparison's verdict: a `Check` holds a run's deviations from its reference, and passes
or not (a parity row within its `Tolerance`, a negative control flagged at `FLAG_RATIO`).

The deviations and the tolerances' values: ``parity_tests.compare``.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Largest accepted deviation per measure, with the reason (``compare.TOLERANCES``)."""

    param: float
    loss: float
    grad_norm: float
    reason: str


# A negative control is flagged when its worst deviation/tolerance ratio reaches this: two
# orders of magnitude above the largest deviation a correct run may show, so that neither
# rounding flags a correct run nor a deviation of a tolerance's size reads as a bug found.
FLAG_RATIO = 100.0


def _worst(values) -> float:
    """Max, with NaN (a diverged run) counted as infinitely far."""
    vals = [math.inf if math.isnan(v) else v for v in values]
    return max(vals) if vals else math.nan


@dataclasses.dataclass
class Check:
    """One comparison: run ``subject`` against run ``reference`` on one scenario.

    ``kind`` is ``"parity"`` (must agree within ``tol``) or ``"control"`` (a
    known-wrong run that must be flagged: worst ratio >= FLAG_RATIO). For a
    control whose error is not numeric (``no_sync_backward_only`` changes only
    communication) ``kind`` is ``"comm-control"`` and ``comm`` holds the
    gradient all-reduces per window of subject and reference. A control whose bug
    is an inf kept in its state is ``"poison-control"``: flagged only by parameters
    that stop being finite (its other errors are other rows' bugs).
    """

    scenario: str
    subject: str
    reference: str
    kind: str
    tol: Tolerance
    param_dev: list[float]
    param_dev_elementwise: list[float]
    loss_dev: list[float]
    grad_norm_dev: list[float]
    count_dev: list[float]
    comm: tuple[float, float] | None = None
    sequences: dict[str, tuple[list, list]] | None = (
        None  # loss scaling: exact per-update sequences
    )
    expected_skipped: list[bool] | None = None  # loss scaling: the windows poisoned with an inf

    @property
    def skipped_as_injected(self) -> bool | None:
        """Whether both runs skipped exactly the windows given an inf (None: not scaled):
        two runs that both missed the injection would still agree with each other."""
        if self.expected_skipped is None or self.sequences is None:
            return None
        return all(run == self.expected_skipped for run in self.sequences["skipped"])

    @property
    def sequences_equal(self) -> bool | None:
        """Whether every compared sequence is equal (None: none compared)."""
        if self.sequences is None:
            return None
        return all(a == b for a, b in self.sequences.values())

    @property
    def ratios(self) -> dict[str, float]:
        """Worst deviation / tolerance, per measure."""
        r = {
            "param": _worst(self.param_dev) / self.tol.param,
            "loss": _worst(self.loss_dev) / self.tol.loss,
        }
        gn = (
            [v for v in self.grad_norm_dev if not math.isnan(v)]
            if self.kind != "parity"
            else self.grad_norm_dev
        )
        if gn:
            r["grad_norm"] = _worst(gn) / self.tol.grad_norm
        return r

    @property
    def passed(self) -> bool:
        if self.kind == "parity":
            ok = all(v <= 1.0 for v in self.ratios.values())
            ok = ok and self.sequences_equal is not False and self.skipped_as_injected is not False
            return ok and _worst(self.count_dev) == 0.0
        if self.kind == "comm-control":
            return self.comm is not None and self.comm[0] > self.comm[1]
        if self.kind == "poison-control":  # non-finite parameters only: an inf in the state
            return self.ratios["param"] == math.inf
        return max(self.ratios.values()) >= FLAG_RATIO

    def row(self) -> dict:
        """A flat dict for the table and the JSON report."""
        return {
            "scenario": self.scenario,
            "subject": self.subject,
            "reference": self.reference,
            "kind": self.kind,
            "param_dev": _worst(self.param_dev),
            "param_dev_elementwise": _worst(self.param_dev_elementwise),
            "loss_dev": _worst(self.loss_dev),
            "grad_norm_dev": _worst(
                [v for v in self.grad_norm_dev if not math.isnan(v)] or [math.nan]
            ),
            "count_dev": _worst(self.count_dev) if self.count_dev else math.nan,
            "tol_param": self.tol.param,
            "tol_loss": self.tol.loss,
            "tol_grad_norm": self.tol.grad_norm,
            "ratios": self.ratios,
            "comm": self.comm,
            "passed": self.passed,
            "sequences": (
                None
                if self.sequences is None
                else {k: {"subject": a, "reference": b} for k, (a, b) in self.sequences.items()}
            ),
            "sequences_equal": self.sequences_equal,
            "skipped_as_injected": self.skipped_as_injected,
            "per_update": {
                "param_dev": self.param_dev,
                "loss_dev": self.loss_dev,
                "grad_norm_dev": self.grad_norm_dev,
            },
        }
