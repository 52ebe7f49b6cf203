"""The parity plot: per check, its worst deviation against the tolerance band.

One panel, one row per check (the full matrix: per comparison and dtype, its
scenarios together), x the deviation over the tolerance on a log scale, so that
every dtype and measure shares the bands: at most 1 is within tolerance, at
least ``FLAG_RATIO`` (100) is a flagged bug. Each row shows every update's
ratio (small dots), the short tail window's (a hollow diamond) and the worst
(a large marker, its value written beside it). Implementations that must agree
are blue, known bugs red (``no_sync_backward_only``, the same numbers by design
and flagged by its all-reduces, a red cross).
"""

from __future__ import annotations

import math
import pathlib

from parity_tests.cases import SHORT_WINDOW
from parity_tests.checks import FLAG_RATIO, Check
from parity_tests.compare import SuiteResult

MAX_ROWS = 32  # more checks than this (the full matrix): one row per comparison and dtype
AGREE, BUG = "tab:blue", "tab:red"
LO, HI = 1e-6, 1e7  # the x axis: deviation / tolerance


def update_ratios(c: Check) -> list[float]:
    """Per update: the largest deviation / tolerance over param, loss and grad norm
    (a measure a known bug leaves unrecorded, NaN, is left out; a poisoned control's
    non-finite parameters count as inf)."""
    per = zip(c.param_dev, c.loss_dev, c.grad_norm_dev, strict=True)
    tols = (c.tol.param, c.tol.loss, c.tol.grad_norm)
    out = []
    for devs in per:
        if c.kind == "poison-control" and not math.isfinite(devs[0]):
            out.append(math.inf)  # parameters no longer finite: what flags it
            continue
        vals = [d / t for d, t in zip(devs, tols, strict=True) if not math.isnan(d)]
        out.append(max(vals) if vals else math.nan)
    return out


def _rows(result: SuiteResult, short_names: dict[str, str]) -> list[tuple[str, list[Check]]]:
    """``(label, checks)`` per row, parity rows first, in the suite's order."""
    ordered = sorted(result.checks, key=lambda c: c.kind != "parity")
    if len(ordered) <= MAX_ROWS:
        return [(_label(c, short_names.get(c.scenario, c.scenario)), [c]) for c in ordered]
    groups: dict[tuple, list[Check]] = {}
    for c in ordered:
        dtype = result.scenarios[c.scenario].dtype if c.scenario in result.scenarios else "?"
        groups.setdefault((c.subject, c.reference, dtype), []).append(c)
    return [
        (f"{s} vs {r}  {d} ({len(cs)} scenarios)" if cs[0].kind == "parity" else s, cs)
        for (s, r, d), cs in groups.items()
    ]


def _label(c: Check, scenario: str) -> str:
    if c.kind == "parity":
        return f"{c.subject} vs {c.reference}  [{scenario}]"
    return f"{c.subject}  [{scenario}]"


def plot(
    result: SuiteResult, path: pathlib.Path, *, title: str, short_names: dict[str, str]
) -> None:
    """Writes the plot (module docstring) to ``path`` (PNG).

    ``title``: its second line (the verdict); ``short_names``: the scenarios' ids.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(result, short_names)
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.3 * len(rows)))
    ax.axvspan(LO, 1.0, color="tab:blue", alpha=0.08, lw=0)
    ax.axvspan(FLAG_RATIO, HI, color="tab:red", alpha=0.08, lw=0)
    ax.axvline(1.0, color="tab:blue", lw=1.2)
    ax.axvline(FLAG_RATIO, color="tab:red", lw=1.2, ls="--")
    for y, (_, checks) in enumerate(rows):
        _draw_row(ax, y, checks)
    n_agree = sum(checks[0].kind == "parity" for _, checks in rows)
    if 0 < n_agree < len(rows):
        ax.axhline(n_agree - 0.5, color="0.4", lw=0.8)
    for x, text, color in ((3e-6, "within tolerance", AGREE), (3e2, "flagged", BUG)):
        ax.text(x, -0.9, text, color=color, fontsize=8.5, va="bottom", weight="bold")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    for tick, (_, checks) in zip(ax.get_yticklabels(), rows, strict=True):
        tick.set_color(BUG if checks[0].kind != "parity" else "black")
    ax.set_ylim(len(rows) - 0.5, -1.3)
    ax.set_xscale("log")
    ax.set_xlim(LO, HI)
    ax.set_xlabel(
        "deviation / tolerance  (largest of param, loss, grad norm; known bugs: the fp32 tolerance)"
    )
    ax.set_title(
        f"jaxaccum vs torch_ref parity ({result.device}{', quick' if result.quick else ''})\n"
        + title,
        fontsize=10,
    )
    _legend(fig)
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw_row(ax, y: int, checks: list[Check]) -> None:
    """Row ``y``: every update's ratio, the short window's (a diamond), the worst (labelled)."""
    bug = checks[0].kind != "parity"
    color = BUG if bug else AGREE
    clamp = lambda v: min(max(v, LO * 1.5), HI / 1.5)
    ratios = [clamp(v) for c in checks for v in update_ratios(c) if not math.isnan(v)]
    tail = [update_ratios(c)[SHORT_WINDOW] for c in checks if len(c.param_dev) > SHORT_WINDOW]
    worst = max(ratios) if ratios else math.nan
    ax.scatter(ratios, [y] * len(ratios), s=9, color=color, alpha=0.45, lw=0)
    if tail and not math.isnan(max(tail)):
        ax.scatter([clamp(max(tail))], [y], s=60, marker="D", facecolor="none",
                   edgecolor="black", lw=1.0, zorder=3)  # fmt: skip
    comm = checks[0].kind == "comm-control"
    ax.scatter([worst], [y], s=70 if comm else 45, color=color, marker="x" if comm else "o",
               zorder=4)  # fmt: skip
    note = f"{worst:.2g}"
    if comm and checks[0].comm:
        note += (
            f"  (flagged by {checks[0].comm[0]:g} all-reduces/window, not {checks[0].comm[1]:g})"
        )
    poisoned = checks[0].kind == "poison-control"
    lost = [u + 1 for u, d in enumerate(checks[0].param_dev) if poisoned and not math.isfinite(d)]
    if lost:  # a poisoned control sits at the right edge: its note goes to its left
        note = f"parameters not finite from update {lost[0]}  "
        ax.annotate(note, (worst, y), xytext=(-75, -3), textcoords="offset points",
                    fontsize=7.5, ha="right")  # fmt: skip
        return
    ax.annotate(note, (worst, y), xytext=(7, -3), textcoords="offset points", fontsize=7.5)


def _legend(fig) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], ls="", marker="o", color="0.3", label="worst update"),
        Line2D([], [], ls="", marker="o", ms=3, color="0.3", alpha=0.5, label="each update"),
        Line2D(
            [],
            [],
            ls="",
            marker="D",
            mfc="none",
            mec="black",
            label=f"update {SHORT_WINDOW + 1}: the short tail window",
        ),  # fmt: skip
        Line2D([], [], color="tab:blue", label="tolerance (1)"),
        Line2D([], [], color="tab:red", ls="--", label=f"flag threshold ({FLAG_RATIO:g})"),
    ]
    fig.legend(handles=handles, fontsize=8, loc="lower center", ncol=5, frameon=False)
