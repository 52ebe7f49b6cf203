"""The parity report: a printed table, ``parity.md``, ``parity.json`` and a loss plot."""

from __future__ import annotations

import json
import math
import pathlib

from parity_tests.compare import FLAG_RATIO, TOLERANCES, Check
from parity_tests.suite import SuiteResult, _key

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
                "equal]" if c.sequences_equal else "DIFFER]"
            )
        out.append(
            (
                c.scenario,
                comparison,
                _fmt(r["param_dev"]),
                _fmt(r["param_dev_elementwise"]),
                _fmt(r["loss_dev"]),
                _fmt(r["grad_norm_dev"]),
                _fmt(r["count_dev"]),
                f"{c.tol.param:g}/{c.tol.loss:g}/{c.tol.grad_norm:g}",
                f"{ratio:.3g}" if c.kind != "comm-control" else "-",
                _result(c),
            )
        )
    return out


def table(result: SuiteResult, markdown: bool = False) -> str:
    data = [HEADER] + rows(result)
    if markdown:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(r) + " |" for r in data[1:]]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in data) for i in range(len(HEADER))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in data]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(result: SuiteResult) -> str:
    parity = [c for c in result.checks if c.kind == "parity"]
    controls = [c for c in result.checks if c.kind != "parity"]
    return (
        f"{sum(c.passed for c in parity)}/{len(parity)} parity checks within tolerance, "
        f"{sum(c.passed for c in controls)}/{len(controls)} negative controls flagged, "
        f"{len(result.errors)} runs failed; {result.seconds:.0f} s"
    )


def _seq(values) -> str:
    return " ".join(("T" if v else "F") if isinstance(v, bool) else f"{v:g}" for v in values)


def scaling_lines(result: SuiteResult) -> list[str]:
    """One line per loss-scaling check and sequence: both runs' per-update values."""
    out = []
    for c in result.checks:
        for key, (a, b) in (c.sequences or {}).items():
            out.append(
                f"{c.scenario}: {key}: {c.subject} [{_seq(a)}], {c.reference} [{_seq(b)}]"
                f" -> {'equal' if a == b else 'DIFFER'}"
            )
    return out


def _json_safe(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write(result: SuiteResult, out: pathlib.Path) -> dict[str, pathlib.Path]:
    """Writes ``parity.md``, ``parity.json`` and ``parity_loss.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "parity.md", "json": out / "parity.json", "plot": out / "parity_loss.png"}
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
        plot(result, paths["plot"])
    except Exception as e:  # noqa: BLE001 - the plot is optional; the numbers are in the JSON
        paths.pop("plot").with_suffix(".txt").write_text(f"plot failed: {e!r}\n")
    paths["md"].write_text(markdown(result, paths.get("plot")))
    return paths


def markdown(result: SuiteResult, plot_path) -> str:
    from parity_tests.compare import __doc__ as measures

    tol_lines = "\n".join(
        f"- **{d}**: param {t.param:g}, loss {t.loss:g}, grad norm {t.grad_norm:g}. {t.reason}"
        for d, t in TOLERANCES.items()
    )
    err = "\n".join(f"### {k}\n```\n{v}\n```" for k, v in result.errors.items()) or "none"
    times = "\n".join(f"- {k}: {r.seconds:.1f} s" for k, r in result.runs.items())
    return f"""# Parity report: jaxaccum vs torch_ref ({result.device}{", quick" if result.quick else ""})

**{"PASS" if result.passed else "FAIL"}**: {summary(result)}.

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
{table(result, markdown=True)}

## Loss scaling (fp16 dynamic loss scale, fp32 compute, an injected overflow)
Per update, compared exactly (``skipped``: the window was dropped; ``loss_scale``: the
scale for the next window; ``update_id``: updates applied so far):

{chr(10).join("- " + line for line in scaling_lines(result)) or "none run"}

{f"![per-update loss]({plot_path.name})" if plot_path else ""}

## Failed runs
{err}

## Run times (compilation included)
{times}
"""


def plot(result: SuiteResult, path: pathlib.Path) -> None:
    """Two panels for the control scenario: per-update logged loss of every run, and
    the parameter deviation of every comparison (log scale) against the tolerance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctl, big = result.control, result.control_big
    keys = [_key("jax big", big), _key("torch big", big)]
    keys += [k for k in result.runs if k.split("|")[1] == ctl]
    fixed = {
        "jax big batch": ("black", "-", 4.0),
        "torch big batch": ("0.55", "--", 2.5),
        "jaxaccum": ("tab:blue", ":", 2.5),
        "torch_ref": ("tab:orange", "-.", 2.0),
    }
    palette = iter(plt.cm.tab20(range(20))[4:])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 6.5))
    for key in keys:
        run = result.runs.get(key)
        if run is None:
            continue
        losses = [r["loss"] for r in run.records]
        color, ls, lw = fixed.get(run.label) or (next(palette), "-", 1.2)
        ax.plot(
            range(1, len(losses) + 1),
            losses,
            ls,
            color=color,
            lw=lw,
            marker="o",
            ms=3,
            label=run.label,
        )
    ax.set_xlabel("update")
    ax.set_ylabel("logged window loss (buggy variants: what their code logs)")
    ax.set_title(f"{ctl}: per-update loss", fontsize=10)
    palette = iter(plt.cm.tab20(range(20)))
    for c in result.checks:
        if c.scenario not in (ctl, big.name):
            continue
        dev = [min(max(v, 1e-12), 1e3) for v in c.param_dev]
        ax2.semilogy(
            range(1, len(dev) + 1),
            dev,
            marker="o",
            ms=3,
            color=next(palette, None),
            lw=2.0 if c.kind == "parity" else 1.0,
            ls={"parity": "-", "control": "--"}.get(c.kind, ":"),
            label=f"{c.subject} vs {c.reference}",
        )
    tol = TOLERANCES["float32"].param
    ax2.axhline(tol, color="r", lw=1.5, label="fp32 tolerance")
    ax2.axhline(
        tol * FLAG_RATIO, color="r", lw=1, ls=":", label=f"{FLAG_RATIO:g} x tolerance (flag)"
    )
    ax2.set_xlabel("update")
    ax2.set_ylabel("||p - p_ref||_2 / ||p_ref - p_0||_2")
    ax2.set_title(
        "parameter deviation: solid = must agree, dashed = must be flagged,\n"
        "dotted = same numbers by design (flagged by communication)",
        fontsize=10,
    )
    for a in (ax, ax2):
        a.set_xticks(
            range(1, len(result.runs[keys[0]].records) + 1) if keys[0] in result.runs else []
        )
        a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
