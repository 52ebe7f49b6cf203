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

from parity_tests.compare import FLAG_RATIO, Check
from parity_tests.suite import SHORT_WINDOW, SuiteResult

MAX_ROWS = 32  # more checks than this (the full matrix): one row per comparison and dtype
AGREE, BUG = "tab:blue", "tab:red"


def update_ratios(c: Check) -> list[float]:
    """Per update: the largest deviation / tolerance over param, loss and grad norm
    (a measure a known bug leaves unrecorded, NaN, is left out)."""
    per = zip(c.param_dev, c.loss_dev, c.grad_norm_dev, strict=True)
    tols = (c.tol.param, c.tol.loss, c.tol.grad_norm)
    out = []
    for devs in per:
        vals = [d / t for d, t in zip(devs, tols, strict=True) if not math.isnan(d)]
        out.append(max(vals) if vals else math.nan)
    return out


def _rows(result: SuiteResult) -> list[tuple[str, list[Check]]]:
    """``(label, checks)`` per row, parity rows first, in the suite's order."""
    from parity_tests.report import short_name

    ordered = sorted(result.checks, key=lambda c: c.kind != "parity")
    if len(ordered) <= MAX_ROWS:
        return [(_label(result, c, short_name(result, c.scenario)), [c]) for c in ordered]
    groups: dict[tuple, list[Check]] = {}
    for c in ordered:
        dtype = result.scenarios[c.scenario].dtype if c.scenario in result.scenarios else "?"
        groups.setdefault((c.subject, c.reference, dtype), []).append(c)
    return [
        (f"{s} vs {r}  {d} ({len(cs)} scenarios)" if cs[0].kind == "parity" else s, cs)
        for (s, r, d), cs in groups.items()
    ]


def _label(result: SuiteResult, c: Check, scenario: str) -> str:
    if c.kind == "parity":
        return f"{c.subject} vs {c.reference}  [{scenario}]"
    return f"{c.subject}  [{scenario}]"


def plot(result: SuiteResult, path: pathlib.Path) -> None:
    """Writes the plot (module docstring) to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(result)
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.3 * len(rows)))
    lo, hi = 1e-6, 1e7
    ax.axvspan(lo, 1.0, color="tab:blue", alpha=0.08, lw=0)
    ax.axvspan(FLAG_RATIO, hi, color="tab:red", alpha=0.08, lw=0)
    ax.axvline(1.0, color="tab:blue", lw=1.2)
    ax.axvline(FLAG_RATIO, color="tab:red", lw=1.2, ls="--")
    for y, (_, checks) in enumerate(rows):
        bug = checks[0].kind != "parity"
        color = BUG if bug else AGREE
        ratios = [v for c in checks for v in update_ratios(c) if not math.isnan(v)]
        ratios = [min(max(v, lo * 1.5), hi / 1.5) for v in ratios]
        tail = [update_ratios(c)[SHORT_WINDOW] for c in checks if len(c.param_dev) > SHORT_WINDOW]
        worst = max(ratios) if ratios else math.nan
        ax.scatter(ratios, [y] * len(ratios), s=9, color=color, alpha=0.45, lw=0)
        if tail and not math.isnan(max(tail)):
            ax.scatter([min(max(max(tail), lo * 1.5), hi / 1.5)], [y], s=60, marker="D",
                       facecolor="none", edgecolor="black", lw=1.0, zorder=3)  # fmt: skip
        comm = checks[0].kind == "comm-control"
        ax.scatter([worst], [y], s=70 if comm else 45, color=color, marker="x" if comm else "o",
                   zorder=4)  # fmt: skip
        note = f"{worst:.2g}"
        if comm and checks[0].comm:
            note += f"  (flagged by {checks[0].comm[0]:g} all-reduces/window, not {checks[0].comm[1]:g})"
        ax.annotate(note, (worst, y), xytext=(7, -3), textcoords="offset points", fontsize=7.5)
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
    ax.set_xlim(lo, hi)
    ax.set_xlabel(
        "deviation / tolerance  (largest of param, loss, grad norm; known bugs: the fp32 tolerance)"
    )
    from parity_tests.report import verdict

    ax.set_title(
        f"jaxaccum vs torch_ref parity ({result.device}{', quick' if result.quick else ''})\n"
        + verdict(result).split(" (")[0],
        fontsize=10,
    )
    _legend(fig)
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
