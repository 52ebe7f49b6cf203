"""Per-update records of a run, the deviation measures, and the tolerances.

Parameter deviation (the acceptance measure), for update ``u`` of run ``a``
against reference run ``b`` that started from ``p_0``::

    dev_u = ||p_a(u) - p_b(u)||_2 / ||p_b(u) - p_0||_2        (L2 over ALL parameters)

i.e. how far apart the two runs are, in units of how far the reference moved.
The elementwise version ``max|p_a(u) - p_b(u)| / max|p_b(u) - p_0|`` is reported
too, for information: AdamW divides each gradient element by its own running
RMS, so an element whose gradient is ~0 (the attention key bias has an exactly
zero gradient in exact arithmetic, softmax being shift invariant) turns
rounding noise into a step of up to ``lr``; the elementwise measure then
reports a few such elements (~1e-3 in fp32) however exact the accumulation is,
while the L2 measure weighs them by how many they are.

Loss and gradient norm (and the norm after clipping, where both runs record
it: a clip coefficient off by a factor is a uniform scale, which AdamW's
parameters barely show): relative difference per update, the worse of the two.
Counted fields (:data:`COUNTED`: the window's items and their running sum,
``update_id``, the skips and their reason): the largest absolute difference per
update over the fields both runs record (integers, exact in float32 up to
2**24; a parity row needs 0).

Loss-scaling scenarios (fp16 dynamic loss scale, an injected overflow) also
compare, per update and exactly, the sequences of ``skipped`` (the window was
dropped), ``loss_scale`` (the scale for the next window: powers of two) and
``update_id`` (updates applied so far): a parity row passes only if they are equal.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from parity_tests.checks import Check, Tolerance


@dataclasses.dataclass
class Run:
    """What one framework did on one scenario.

    Attributes:
      label: who ran it (``"jaxaccum"``, ``"torch_ref"``, ``"torch_ref:mean_of_means"``, ...).
      records: one dict per update with ``loss`` (window mean; under a bug what
        the buggy code logs), ``window_items``, ``grad_norm`` (may be NaN if
        unknown), ``update_id``.
      params: ``n_updates + 1`` torch-layout float64 state dicts, initial first.
      seconds: wall time of the run (compilation included).
      extra: anything else (e.g. torch's communication counts).
    """

    label: str
    records: list[dict]
    params: list[dict[str, np.ndarray]]
    seconds: float = 0.0
    extra: dict = dataclasses.field(default_factory=dict)


# The tolerances, per dtype. Reasons are in the strings: they are printed in the report.
_FLOAT64 = (
    "fp64 (unit roundoff 1.1e-16): the same sums in different orders and 5 AdamW steps; "
    "measured <= 1.5e-14 (param), 3.4e-16 (loss) for torch_ref's layouts and 4.8e-14 for the "
    "two big batches without clipping; 1e-9 leaves 2e4x room over the worst"
)
_FLOAT32 = (
    "fp32 (unit roundoff 6e-8): the frameworks and layouts add the same per-token terms in "
    "different orders (~1e3 loss terms, ~1e5 gradient elements), and AdamW amplifies gradient "
    "rounding where an element's gradient is ~eps; measured over the CPU matrix <= 2.8e-5 "
    "(param), 3.1e-7 (loss), 4.2e-7 (grad norm); 1e-4 leaves 3.5x room over the worst"
)
_BFLOAT16 = (
    "bf16 matmuls (fp32 parameters, optimizer and loss): unit roundoff 3.9e-3 per product; "
    "torch autocast and the Flax dtype policy round different intermediates, and AdamW turns "
    "gradient noise into sign-level steps for small elements; calibrated on CPU (measured "
    "param 5.6e-2, loss 6.5e-5, grad norm 2.6e-3 for the big batch), not yet on a GPU"
)
TOLERANCES = {  # (param, loss, grad_norm, reason)
    "float64": Tolerance(1e-9, 1e-12, 1e-9, _FLOAT64),
    "float32": Tolerance(1e-4, 2e-6, 5e-6, _FLOAT32),
    "bfloat16": Tolerance(0.15, 1e-3, 1e-2, _BFLOAT16),
}


def _l2(tree: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(np.square(v))) for v in tree.values()))


def _diff(a: dict, b: dict) -> dict:
    if set(a) != set(b):
        raise ValueError(f"params: different names: {sorted(set(a) ^ set(b))}")
    return {n: np.asarray(a[n], np.float64) - np.asarray(b[n], np.float64) for n in a}


def param_deviation(a: Run, b: Run) -> list[float]:
    """Per update: ``||p_a - p_b||_2 / ||p_b - p_0||_2`` (see module docstring)."""
    _check_lengths(a, b)
    out = []
    for u in range(1, len(b.params)):
        moved = _l2(_diff(b.params[u], b.params[0]))
        out.append(_l2(_diff(a.params[u], b.params[u])) / moved if moved > 0 else math.inf)
    return out


def param_deviation_elementwise(a: Run, b: Run) -> list[float]:
    """Per update: ``max|p_a - p_b| / max|p_b - p_0|`` (information only)."""
    _check_lengths(a, b)
    out = []
    for u in range(1, len(b.params)):
        moved = max(float(np.max(np.abs(v))) for v in _diff(b.params[u], b.params[0]).values())
        dev = max(float(np.max(np.abs(v))) for v in _diff(a.params[u], b.params[u]).values())
        out.append(dev / moved if moved > 0 else math.inf)
    return out


def _gap(x: float, y: float, *, relative: bool) -> float:
    """``|x - y|`` (``/ |y|``); 0 when both records say the same non-number (NaN and
    NaN: no loss to record; inf and inf), NaN when only one of them is a number."""
    if x == y or (math.isnan(x) and math.isnan(y)):
        return 0.0
    return abs(x - y) / abs(y) if relative and y != 0 else abs(x - y)


def relative(a: Run, b: Run, key: str) -> list[float]:
    """Per update ``|a - b| / |b|`` of a record field (NaN where only one is unknown)."""
    _check_lengths(a, b)
    return [
        _gap(float(ra.get(key, math.nan)), float(rb.get(key, math.nan)), relative=True)
        for ra, rb in zip(a.records, b.records, strict=False)
    ]


def absolute(a: Run, b: Run, key: str) -> list[float]:
    """Per update ``|a - b|`` of a record field."""
    _check_lengths(a, b)
    return [
        _gap(float(ra.get(key, math.nan)), float(rb.get(key, math.nan)), relative=False)
        for ra, rb in zip(a.records, b.records, strict=False)
    ]


# The per-update record fields a parity row needs equal, where both runs record them (not
# micro_step: the rows compare different layouts of one window, k micro-batches or k R).
COUNTED = ("window_items", "cumulative_items", "update_id", "skip_count", "skip_reason", "skipped")


def _recorded(a: Run, b: Run, keys: tuple[str, ...]) -> list[str]:
    """The ``keys`` that every record of both runs holds."""
    return [k for k in keys if all(k in r for r in a.records + b.records)]


def _per_update_worst(gaps: list[list[float]]) -> list[float]:
    """Per update, the largest of several measures' gaps (NaN if any is NaN)."""
    worst = lambda values: math.nan if any(map(math.isnan, values)) else max(values)
    return [worst(values) for values in zip(*gaps, strict=True)] if gaps else []


def count_gaps(a: Run, b: Run) -> list[float]:
    """Per update, the largest ``|a - b|`` of the :data:`COUNTED` fields both runs record
    (``window_items`` always: a run without it reads NaN there, which fails a parity row)."""
    keys = ("window_items", *_recorded(a, b, COUNTED[1:]))
    return _per_update_worst([absolute(a, b, key) for key in keys])


def norm_gaps(a: Run, b: Run) -> list[float]:
    """Per update, the relative gap of ``grad_norm`` and of ``grad_norm_clipped`` (where
    both runs record it), the worse of the two."""
    keys = ("grad_norm", *_recorded(a, b, ("grad_norm_clipped",)))
    return _per_update_worst([relative(a, b, key) for key in keys])


# The per-update record fields a loss-scaling check compares exactly.
SCALING_SEQUENCES = ("skipped", "loss_scale", "update_id")


def sequences(a: Run, b: Run, keys=SCALING_SEQUENCES) -> dict[str, tuple[list, list]]:
    """``{key: (a's per-update values, b's)}``, as plain bools/floats/ints (exact comparison)."""
    _check_lengths(a, b)
    cast = {"skipped": bool, "update_id": int}
    return {
        k: tuple([cast.get(k, float)(r[k]) for r in run.records] for run in (a, b)) for k in keys
    }


def _check_lengths(a: Run, b: Run) -> None:
    if len(a.records) != len(b.records) or len(a.params) != len(b.params):
        raise ValueError(f"{a.label} has {len(a.records)} updates, {b.label} has {len(b.records)}")


def compare(
    scenario: str,
    subject: Run,
    reference: Run,
    tol: Tolerance,
    kind: str = "parity",
    comm: tuple[float, float] | None = None,
    scaling: bool = False,
    expected_skipped: list[bool] | None = None,
) -> Check:
    """Builds the :class:`Check` of ``subject`` against ``reference`` (``scaling``: also
    the exact :data:`SCALING_SEQUENCES`, and ``expected_skipped``: the windows that
    must be skipped)."""
    return Check(
        scenario=scenario,
        subject=subject.label,
        reference=reference.label,
        kind=kind,
        tol=tol,
        param_dev=param_deviation(subject, reference),
        param_dev_elementwise=param_deviation_elementwise(subject, reference),
        loss_dev=relative(subject, reference, "loss"),
        grad_norm_dev=norm_gaps(subject, reference),
        count_dev=count_gaps(subject, reference) if kind == "parity" else [],
        comm=comm,
        sequences=sequences(subject, reference) if scaling else None,
        expected_skipped=expected_skipped,
    )


@dataclasses.dataclass
class SuiteResult:
    """Everything a run of the suite produced: what the report (``parity_tests.report``,
    ``report_files``, ``plot``) reads."""

    device: str
    quick: bool
    checks: list[Check]
    runs: dict[str, Run]  # by run key (``parity_tests.suite._key``)
    errors: dict[str, str]  # run key -> traceback of a run that failed
    seconds: float
    # every scenario run (and its big batch), by name: each with its short_name and dtype
    # (a parity_tests.cases.Case or Scenario)
    scenarios: dict[str, Any]

    @property
    def passed(self) -> bool:
        return not self.errors and all(c.passed for c in self.checks)
