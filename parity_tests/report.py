"""The parity report as printed: the verdict first, a legend, a table, in 100 columns.

:func:`render` turns a ``SuiteResult`` into its :class:`Text` once: what
``python -m parity_tests`` prints (:func:`verdict`, :func:`legend`, :func:`table`,
:func:`comm_lines` and :func:`scaling_lines` with ``short=True``) and the words
the files take over (``parity_tests.report_files``: ``parity.md`` with every
measure of every check, ``parity.json``, the plot).
"""

from __future__ import annotations

import dataclasses
import math
import textwrap

from parity_tests.cases import DEFAULT_OPT, SHORT_WINDOW
from parity_tests.checks import FLAG_RATIO, Check
from parity_tests.compare import TOLERANCES, SuiteResult
from parity_tests.scenarios import DTYPE_IDS

WIDTH = 100  # the terminal output's columns


@dataclasses.dataclass(frozen=True)
class Text:
    """The report's words, rendered once (:func:`render`).

    Attributes:
      lines: what is printed, in order: the verdict, the legend, the table, the notes.
      verdict: the one-line verdict (:func:`verdict`).
      scaling: the loss-scaling sequences in ``parity.md``'s form (:func:`scaling_lines`).
      short_names: each scenario's id in the table (:func:`short_name`), by name.
    """

    lines: list[str]
    verdict: str
    scaling: list[str]
    short_names: dict[str, str]


def render(result: SuiteResult) -> Text:
    """The :class:`Text` of ``result``."""
    line = verdict(result)
    notes = comm_lines(result) + scaling_lines(result, short=True)
    lines = [line, *legend(result), "", table(result), "", *notes]
    names = {c.scenario: short_name(result, c.scenario) for c in result.checks}
    return Text(lines, line, scaling_lines(result), names)


def verdict(result: SuiteResult) -> str:
    """The one-line verdict: ``PASS: 12/12 checks within tolerance, 12/12 known bugs flagged (..)``."""
    parity = [c for c in result.checks if c.kind == "parity"]
    bugs = [c for c in result.checks if c.kind != "parity"]
    line = (
        f"{'PASS' if result.passed else 'FAIL'}: {sum(c.passed for c in parity)}/{len(parity)}"
        f" checks within tolerance, {sum(c.passed for c in bugs)}/{len(bugs)} known bugs flagged"
    )
    if result.errors:
        line += f", {len(result.errors)} runs FAILED"
    return line + f" ({result.seconds:.0f} s)"


def short_name(result: SuiteResult, name: str) -> str:
    """A scenario's id in the table (``R2k2-token-f32``; the legend says the rest)."""
    scn = result.scenarios.get(name)
    return scn.short_name if scn is not None else name


def _e(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def legend(result: SuiteResult) -> list[str]:
    """What the scenario ids and the columns of :func:`table` mean, in :data:`WIDTH` columns."""
    n = max((len(r.records) for r in result.runs.values()), default=0)
    dtypes = sorted({s.dtype for s in result.scenarios.values()})
    tols = ", ".join(
        f"{DTYPE_IDS[d]} {_e(TOLERANCES[d].param)}/{_e(TOLERANCES[d].loss)}"
        f"/{_e(TOLERANCES[d].grad_norm)}"
        for d in dtypes
    )
    ids = (
        "Scenario ids: R<ranks>k<micro-batches per rank>-<loss unit>-<dtype>; -fp16scale: dynamic"
        " loss scaling, an overflow injected; R1k1 = the big batch. All: the same skewed corpus"
        f" samples, {n} AdamW updates, update {SHORT_WINDOW + 1} a short tail window (half the"
        f" samples, 1 micro-batch per rank), warmup-cosine LR, clipping at"
        f" {DEFAULT_OPT.max_grad_norm:g}."
    )
    columns = (
        f"Columns: the worst of the {n} updates of param = ||p - p_ref|| / ||p_ref - p0|| and of"
        " the relative loss and gnorm; ratio = worst deviation / tolerance: a check passes at"
        f" <= 1, a known bug is flagged at >= {FLAG_RATIO:g}. Tolerances param/loss/gnorm: {tols}"
        " (the bugs: f32's)."
    )
    return textwrap.wrap(ids, WIDTH) + textwrap.wrap(columns, WIDTH)


def _terminal_result(c: Check) -> str:
    if c.kind == "comm-control":  # explained by comm_lines
        return "flagged (comm)" if c.passed else "MISSED (comm)"
    if c.kind in ("control", "poison-control"):
        return "flagged" if c.passed else "MISSED"
    if c.passed:
        return "pass"
    if c.sequences_equal is False:
        return "FAIL: sequences"
    if c.skipped_as_injected is False:
        return "FAIL: skips"
    return "FAIL: counts" if all(v <= 1.0 for v in c.ratios.values()) else "FAIL"


def _table_row(c: Check) -> tuple[str, ...]:
    r = c.row()
    label = f"  {c.subject} vs {c.reference}" if c.kind == "parity" else f"    {c.subject}"
    ratio = "-" if c.kind == "comm-control" else f"{max(c.ratios.values()):.2g}"
    devs = (r["param_dev"], r["loss_dev"], r["grad_norm_dev"])
    return (label, *(_fmt1(v) for v in devs), ratio, _terminal_result(c))


def table(result: SuiteResult) -> str:
    """The checks grouped by scenario: parity first, then the known bugs (100 columns)."""
    widths = (38, 7, 7, 7, 7, 0)
    lines = [("comparison", "param", "loss", "gnorm", "ratio", "result")]
    for name in dict.fromkeys(c.scenario for c in result.checks):
        mine = [c for c in result.checks if c.scenario == name]
        bugs = [c for c in mine if c.kind != "parity"]
        lines.append((short_name(result, name),))
        lines += [_table_row(c) for c in mine if c.kind == "parity"]
        if bugs:
            poisoned = any(c.kind == "poison-control" for c in bugs)
            refs = " or ".join(dict.fromkeys(c.reference for c in bugs))
            versus = (
                f"each vs {refs} (an inf injected)"
                if poisoned
                else "each vs its framework's big batch"
            )
            lines.append((f"  known bugs, {versus}:",))
            lines += [_table_row(c) for c in bugs]
    out = []
    for line in lines:
        cells = zip(line, widths, strict=False) if len(line) > 1 else [(line[0], 0)]
        out.append("  ".join(v.ljust(w) for v, w in cells).rstrip())
    out.insert(1, "-" * WIDTH)
    return "\n".join(out)


def _fmt1(x: float) -> str:
    if math.isnan(x):
        return "-"
    return "inf" if math.isinf(x) else f"{x:.1e}"


def comm_lines(result: SuiteResult) -> list[str]:
    """The known bug that changes no number, and the count that flags it."""
    return [
        f"{c.subject}: same numbers by design; {c.comm[0]:g} grad all-reduces per window,"
        f" not {c.comm[1]:g}"
        for c in result.checks
        if c.kind == "comm-control" and c.comm
    ]


def _seq(values) -> str:
    return " ".join(("T" if v else "F") if isinstance(v, bool) else f"{v:g}" for v in values)


def scaling_lines(result: SuiteResult, short: bool = False) -> list[str]:
    """One line per loss-scaling check and sequence: both runs' per-update values
    (``short``: the terminal's form, within :data:`WIDTH`)."""
    out = []
    for c in result.checks:
        for key, (a, b) in (c.sequences or {}).items():
            if short:
                name = short_name(result, c.scenario)
                same = f"{c.subject} = {c.reference} = [{_seq(a)}]"
                out.append(
                    f"{name} {key}: " + (same if a == b else f"[{_seq(a)}] DIFFER [{_seq(b)}]")
                )
            else:
                out.append(
                    f"{c.scenario}: {key}: {c.subject} [{_seq(a)}], {c.reference} [{_seq(b)}]"
                    f" -> {'equal' if a == b else 'DIFFER'}"
                )
    return out
