"""The parity report's files: ``parity.md`` (every measure of every check), ``parity.json``
(every check and run record), ``parity_deviation.png`` (``parity_tests.plot``).

:func:`write` takes the ``SuiteResult`` and its rendered words (``parity_tests.report.Text``)."""

from __future__ import annotations

import json
import math
import pathlib

from parity_tests import plot as plotting
from parity_tests.checks import FLAG_RATIO, Check
from parity_tests.compare import TOLERANCES, SuiteResult
from parity_tests.report import Text

HEADER = (
    "scenario",
    "comparison",
    "param dev",
    "(elementwise)",
    "loss dev",
    "grad-norm dev",
    "count dev",
    "tol param/loss/gnorm",
    "worst ratio",
    "result",
)


MEASURES = ("param_dev", "param_dev_elementwise", "loss_dev", "grad_norm_dev", "count_dev")


def _fmt(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.2e}" if isinstance(x, float) else str(x)


def _result(c: Check) -> str:
    if c.kind == "parity":
        return "pass" if c.passed else "FAIL"
    return "flagged" if c.passed else "NOT FLAGGED (FAIL)"


def rows(result: SuiteResult) -> list[tuple[str, ...]]:
    """The table rows, one per check (errors are listed separately)."""
    out = []
    for c in result.checks:
        r = c.row()
        ratio = max(c.ratios.values())
        comparison = f"{c.subject} vs {c.reference}"
        if c.kind == "comm-control":
            comparison += (
                f" [grad all-reduces/window {c.comm[0]:g} vs {c.comm[1]:g}]"
                if c.comm
                else " [no counts]"
            )
        if c.sequences is not None:
            comparison += " [skipped/loss_scale/update_id sequences " + (
                "equal" if c.sequences_equal else "DIFFER"
            )
            comparison += (
                ", the injected inf skipped]" if c.skipped_as_injected else ", NOT as injected]"
            )
        out.append(
            (
                c.scenario,
                comparison,
                *(_fmt(r[key]) for key in MEASURES),
                f"{c.tol.param:g}/{c.tol.loss:g}/{c.tol.grad_norm:g}",
                f"{ratio:.3g}" if c.kind != "comm-control" else "-",
                _result(c),
            )
        )
    return out


def markdown_table(result: SuiteResult) -> str:
    """Every measure of every check, one row each (``parity.md``)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows(result)])


def _json_safe(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write(result: SuiteResult, out: pathlib.Path, text: Text) -> dict[str, pathlib.Path]:
    """Writes ``parity.md``, ``parity.json`` and ``parity_deviation.png`` into ``out``
    (``text``: ``report.render(result)``)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "md": out / "parity.md",
        "json": out / "parity.json",
        "plot": out / "parity_deviation.png",
    }
    paths["json"].write_text(
        json.dumps(
            _json_safe(
                {
                    "device": result.device,
                    "quick": result.quick,
                    "passed": result.passed,
                    "seconds": result.seconds,
                    "flag_ratio": FLAG_RATIO,
                    "tolerances": {
                        d: {
                            "param": t.param,
                            "loss": t.loss,
                            "grad_norm": t.grad_norm,
                            "reason": t.reason,
                        }
                        for d, t in TOLERANCES.items()
                    },
                    "checks": [c.row() for c in result.checks],
                    "errors": result.errors,
                    "runs": {
                        k: {
                            "label": r.label,
                            "seconds": r.seconds,
                            "records": r.records,
                            "extra": {e: v for e, v in r.extra.items()},
                        }
                        for k, r in result.runs.items()
                    },
                }
            ),
            indent=1,
        )
    )
    try:
        title = text.verdict.split(" (")[0]
        plotting.plot(result, paths["plot"], title=title, short_names=text.short_names)
    except Exception as e:  # noqa: BLE001 - the plot is optional; the numbers are in the JSON
        paths.pop("plot").with_suffix(".txt").write_text(f"plot failed: {e!r}\n")
    paths["md"].write_text(markdown(result, paths.get("plot"), text))
    return paths


def markdown(result: SuiteResult, plot_path, text: Text) -> str:
    from parity_tests.compare import __doc__ as measures

    tol_lines = "\n".join(
        f"- **{d}**: param {t.param:g}, loss {t.loss:g}, grad norm {t.grad_norm:g}. {t.reason}"
        for d, t in TOLERANCES.items()
    )
    err = "\n".join(f"### {k}\n```\n{v}\n```" for k, v in result.errors.items()) or "none"
    times = "\n".join(f"- {k}: {r.seconds:.1f} s" for k, r in result.runs.items())
    return f"""# Parity report: jaxaccum vs torch_ref ({result.device}{", quick" if result.quick else ""})

**{"PASS" if result.passed else "FAIL"}**: {text.verdict.split(": ", 1)[1]}.

Each row compares per-update records and parameters after each of the 5 AdamW
updates; the worst update is shown. Parity rows pass when every measure is
within its tolerance and window counts match exactly; negative controls (known
bugs) pass when their worst deviation/tolerance ratio is at least {FLAG_RATIO:g}
(``no_sync_backward_only`` changes no number by design: it is flagged by its
gradient all-reduces per window, k instead of 1).

## Measures
{measures}
## Tolerances
{tol_lines}

Negative controls are judged against the float32 tolerance.

## Results
{markdown_table(result)}

## Loss scaling (fp16 dynamic loss scale, fp32 compute, an injected overflow)
Per update, compared exactly (``skipped``: the window was dropped; ``loss_scale``: the
scale for the next window; ``update_id``: updates applied so far):

{chr(10).join("- " + line for line in text.scaling) or "none run"}

{f"![worst deviation per check]({plot_path.name})" if plot_path else ""}

## Failed runs
{err}

## Run times (compilation included)
{times}
"""
