"""Section 1's reading of the compiled train steps: their parameter-shaped copies, and the
operations each call launches.

Read from each variant's HLO by ``testkit.hlo`` (:func:`copies`, :func:`operations`);
the tables and prose under "Why, from the compiled HLO" are formatted from those
counts (:func:`analysis`, :func:`operations_table`), except the rows of earlier
versions, quoted from earlier runs of this benchmark and labelled with their dates.
"""

from __future__ import annotations

from typing import Any

from benchmarks._common import table
from testkit import hlo


def copies(compiled_hlo: str, params: Any, k: int, *, accumulating: bool) -> dict[str, int]:
    """Parameter-shaped copies on a micro-step's path, at the boundary, per window.

    ``accumulating``: jaxaccum (the boundary loop runs once per window); otherwise
    optax.MultiSteps (every call runs the same path).
    """
    found = hlo.copies_of(compiled_hlo, params)
    return _on_paths(found, k, accumulating, counted="copies", summed="bytes")


def operations(compiled_hlo: str, k: int, *, accumulating: bool) -> dict[str, int]:
    """Operations launched (fused kernels, copies, dots, loop tests) and the bytes they
    write, per micro-step, boundary and window, as :func:`copies` counts its copies."""
    found = hlo.operations(compiled_hlo)
    return _on_paths(found, k, accumulating, counted="ops", summed="written")


def _on_paths(found: list[dict], k: int, accumulating: bool, *, counted: str, summed: str):
    """``{path}_{counted}`` and ``{path}_{summed}`` (their bytes) for ``between`` (a
    micro-step), ``boundary`` and ``window``."""
    count, size = (
        hlo.per_window(found, k=k, accumulating=accumulating, field=field)
        for field in ("count", "bytes")
    )
    paths = {"between": "micro_step", "boundary": "boundary", "window": "window"}
    return {
        f"{path}_{name}": totals[key]
        for path, key in paths.items()
        for name, totals in ((counted, count), (summed, size))
    }


def pairs(results: list[dict], k: int) -> list[tuple[dict, dict]]:
    """``(jaxaccum, optax.MultiSteps)`` results of one model, inner optimizer and donation
    at ``k``, in the results' order."""
    by = {(r["model"], r["inner"], r["donate"], r["label"]): r for r in results if r["k"] == k}
    theirs = lambda r: by.get((r["model"], r["inner"], r["donate"], LABELS[1]))
    return [(r, theirs(r)) for r in by.values() if r["label"] == LABELS[0] and theirs(r)]


def case_cells(r: dict) -> list[str]:
    """A result's model, inner optimizer and donation, as a table row's first cells."""
    return [r["model"], r["inner"], "yes" if r["donate"] else "no"]


def operations_table(results: list[dict], k: int) -> str:
    """Operations and bytes written per window at ``k``, each model and donation: jaxaccum's
    next to optax's, and what the writes mean without donation."""
    ours_label, theirs_label = LABELS
    rows, written = [], lambda r: f"{r['window_written'] / r['param_bytes']:.1f} P"
    for ours, theirs in pairs(results, k):
        n, m = ours["window_ops"], theirs["window_ops"]
        bytes_ratio = ours["window_written"] / theirs["window_written"]
        rows.append([*case_cells(ours), str(n), str(m), f"{n / m:.2f}", written(ours),
                     written(theirs), f"{bytes_ratio:.2f}"])  # fmt: skip
    header = ["model", "inner", "donated", f"{ours_label}: operations / window",
              f"{theirs_label}: operations / window", "ratio", f"{ours_label}: written / window",
              f"{theirs_label}: written / window", "ratio"]  # fmt: skip
    return "\n".join(
        [
            f"**Operations and bytes written per window** (k = {k}): the instructions of the "
            "compiled programs that run as an operation of their own (fused kernels, copies, "
            "dots, the loops' tests), counted on each path as the copies are, and the bytes of "
            "their results (P = the parameters' bytes). A call of the tiny GPT is many small "
            "operations, each with a fixed cost, so their number weighs on its ratios; the "
            "MLP's are few and large, and their bytes weigh.",
            "",
            table(header, rows),
            "",
            *_not_donated_writes([r for r in results if r["k"] == k]),
        ]
    )


def _largest_adamw(results: list[dict]) -> str | None:
    """The largest model run with AdamW (the one the prose reads its counts from)."""
    adamw = [r for r in results if r["inner"] == "adamw"]
    return max(adamw, key=lambda r: r["param_bytes"])["model"] if adamw else None


def _not_donated_writes(at_k: list[dict]) -> list[str]:
    """Why, without donation, jaxaccum writes more per window than optax.MultiSteps at any k
    (the largest model's counts)."""
    largest = _largest_adamw(at_k)
    pick = {r["label"]: r for r in at_k if r["model"] == largest and r["inner"] == "adamw"
            and not r["donate"]}  # fmt: skip
    if set(pick) != set(LABELS):
        return []
    ours, theirs = pick[LABELS[0]], pick[LABELS[1]]
    written_p = lambda r, where: r[f"{where}_written"] / r["param_bytes"]
    micro, boundary = written_p(ours, "between"), written_p(ours, "boundary")
    call = written_p(theirs, "between")
    floor = lambda k: (k * micro + 1) / (k * call)  # the boundary: a micro-step + the updates
    if floor(8) <= 1:  # a micro-step that writes less than optax's call: no bound to state
        return []
    k = ours["k"]
    compiled = ours["window_written"] / theirs["window_written"]
    return [
        f"Without donation ({ours['model']}, AdamW) every output of a call is a fresh buffer. "
        f"A jaxaccum micro-step writes {micro:.2f} P, what optax.MultiSteps' call writes "
        f"({call:.2f} P: the parameters, the optimizer state and the gradient). The boundary "
        f"writes {boundary:.2f} P: a micro-step's writes, the window gradient, the inner state "
        "once more (updated in place in its copy), the updates (1 P) and the zeroed sums. Of "
        "those, the updates are a write no fusion can remove: `update` returns them out of the "
        "loop that runs the inner step at the boundary only, where optax.MultiSteps adds them "
        "to the parameters in the pass that computes them. So without donation jaxaccum writes "
        "more per window than optax.MultiSteps for every k: at least "
        f"{floor(2):.2f}x, {floor(4):.2f}x and {floor(8):.2f}x at k = 2, 4 and 8, and "
        f"{compiled:.2f}x at k = {k} as compiled. Running the inner step on every call "
        "instead, as optax.MultiSteps does, writes more, not less (on the 10M MLP: the "
        "prototype under the table of earlier versions).",
    ]


# Per-window copies (MLP 10 x 1000x1000, AdamW, k = 4; in P) and CPU-time ratios of earlier
# versions, measured by this benchmark on the dates given (docs/benchmarks.md of those days; the
# prototype of 2026-12-03, not kept: `once_if` computed its body and selected; 7 rounds).
HISTORY_MODEL, HISTORY_K = "MLP (10 x 1000x1000, 10.00M params)", 4
HISTORY = {
    "jaxaccum 0.1 (one while loop, select over the inner state), 2026-11-30":
        ("7.6 P", "15.6 P", 0.81, 1.55),
    "jaxaccum 0.1, lax.cond boundary (removed), 2026-11-30": ("20.6 P", "12.6 P", 1.48, 1.22),
    "jaxaccum 0.2, sums reset to fresh zeros, 2026-12-01": ("2.0 P", "10.0 P", 0.76, 1.23),
    "inner step on every call (prototype, not kept), 2026-12-03": ("8.0 P", "0.0 P", 1.66, 1.41),
}  # fmt: skip
EVERY_CALL_WRITTEN = 32.26  # that prototype's bytes written per window, not donated, in P


# The variants compared, in the table's order, and the donation columns.
LABELS, DONATION = ("jaxaccum", "optax.MultiSteps"), (True, False)


def in_p(r: dict, where: str) -> float:
    """Bytes copied on a path (``between``, ``boundary``, ``window``) in units of P."""
    return r[where + "_bytes"] / r["param_bytes"]


def cell(r: dict, where: str) -> str:
    """``copies (bytes in P)`` on a path."""
    return f"{r[where + '_copies']} ({in_p(r, where):.1f} P)"


def window_p(r: dict) -> str:
    """The bytes copied per window, in P."""
    return f"{in_p(r, 'window'):.1f} P"


def analysis(results: list[dict], k: int) -> tuple[str, list[str]]:
    """The copy analysis, with this run's counts (largest model, AdamW).

    Returns the markdown and the figures it quotes from other runs (for the report's header).
    """
    model = _largest_adamw(results)
    pick = {
        (r["label"], r["donate"]): r
        for r in results
        if r["model"] == model and r["inner"] == "adamw"
    }
    if not all((label, d) in pick for label in LABELS for d in DONATION):
        return "", []
    lines = [
        f"**Why, from the compiled HLO** ({model}, AdamW; parameter-shaped `copy` instructions "
        "on each path, bytes in units of P = the parameters' bytes; per window = (k - 1) "
        "micro-steps + the boundary):",
        "",
        copies_table(pick),
        "",
        *why_copies(pick),
    ]
    quoted = []
    if model == HISTORY_MODEL and k == HISTORY_K:  # the model and window the history measured
        quoted.append("section 1's rows of earlier versions, each with the date it was measured")
        lines += ["", against_history(pick[("jaxaccum", True)], pick[("jaxaccum", False)])]
    return "\n".join(lines), quoted


def copies_table(pick: dict[tuple[str, bool], dict]) -> str:
    """Copies on a micro-step's path, at the boundary and per window, donated and not."""
    rows = [
        [label]
        + [
            x
            for d in DONATION
            for x in (
                cell(pick[(label, d)], "between"),
                cell(pick[(label, d)], "boundary"),
                window_p(pick[(label, d)]),
            )
        ]
        for label in LABELS
    ]
    header = [
        "variant",
        "donated: micro-step",
        "donated: boundary",
        "donated: per window",
        "not donated: micro-step",
        "not donated: boundary",
        "not donated: per window",
    ]
    return table(header, rows)


def why_copies(pick: dict[tuple[str, bool], dict]) -> list[str]:
    """One bullet per variant: what its copies are, from the counts."""
    ours, ours_nd = pick[("jaxaccum", True)], pick[("jaxaccum", False)]
    theirs, theirs_nd = pick[("optax.MultiSteps", True)], pick[("optax.MultiSteps", False)]
    inner_p = ours["inner_bytes"] / ours["param_bytes"]  # the inner AdamW state, in P
    same_size = lambda r, where: abs(in_p(r, where) - inner_p) < 0.05  # to the table's 0.1 P
    paths = f"a micro-step's path has {cell(ours, 'between')} and the boundary's {cell(ours, 'boundary')}"
    if ours["between_copies"] == 0 and ours["boundary_copies"] == 0:
        donated = (
            f"{paths}: between boundaries the loop makes no trip and every buffer stays where "
            "it is; at the boundary the window sums are reset by a select that XLA writes into "
            "each sum's own buffer, after the division has read it (fresh zeros cost two copies "
            "per leaf: the old sum kept for the division, the zeros put in its place), and the "
            "inner state is updated in place in a nested loop that makes one trip only for an "
            "applied window (no select over the inner state)"
        )
    else:
        donated = f"{paths}, where jaxaccum/_copies_test.py expects none: a copy came back"
    size = "the size of" if same_size(ours_nd, "between") else "to compare with"
    not_donated = (
        f"jaxaccum's program has {cell(ours_nd, 'between')} on a micro-step's path and "
        f"{cell(ours_nd, 'boundary')} at the boundary, {size} its inner AdamW state "
        f"({inner_p:.1f} P): without "
        "donation JAX gives every output its own buffer, and the inner state, which a "
        "micro-step does not change, is copied into it (at the boundary the loop then updates "
        f"the copy in place); optax.MultiSteps's has {cell(theirs_nd, 'between')}: it writes "
        "the same outputs by recomputing AdamW on every call. The copy stays: one compiled "
        "program serves every call and cannot tell whether its inputs were donated; XLA "
        "puts the copy of a non-donated input that reaches an output before the loop, on "
        "every call's path (a `lax.cond` in the loop's place gets the same copies), and "
        "writing the unchanged state through an arithmetic pass instead would cost the "
        "donated program that pass on every micro-step"
    )
    return [
        f"- *jaxaccum, donated.* The loop carry aliases the donated state buffers: {donated}.",
        "- *optax.MultiSteps, donated.* It runs AdamW on every call, and every call's path has "
        f"{cell(theirs, 'between')} (the parameters, the inner state and the accumulator hold "
        f"{2 + inner_p:.1f} P together).",
        f"- *not donated.* {not_donated}. The copy weighs most at small k, and so do the "
        "boundary's own passes (the division, the norm, the reset, the inner update into the "
        "updates' slot, each in a pass of its own in the numbers' current order, which stays "
        "bitwise), where optax.MultiSteps fuses AdamW into the writes it makes on every call. "
        "Donate the train step's params and optimizer state (`donate_argnums`): jaxaccum then "
        "copies nothing.",
    ]


def against_history(ours: dict, ours_nd: dict) -> str:
    """This run's jaxaccum copies and ratios per window next to earlier versions' (quoted)."""
    history = [
        [label, donated_p, not_donated_p, f"{r_d:.2f}", f"{r_nd:.2f}"]
        for label, (donated_p, not_donated_p, r_d, r_nd) in HISTORY.items()
    ] + [
        [
            "jaxaccum, this run",
            window_p(ours),
            window_p(ours_nd),
            f"{ours['ratio_window_cpu']:.2f}",
            f"{ours_nd['ratio_window_cpu']:.2f}",
        ]
    ]
    header = ["variant", "copies, donated", "copies, not donated", "ratio, donated",
              "ratio, not donated"]  # fmt: skip
    return "\n".join(
        [
            "Per window, against earlier versions (copies in P; per-window CPU-time ratio "
            "against optax.MultiSteps; the earlier rows are not from this run: this benchmark "
            "measured them on the dates they give; those before 2026-12-03 against an "
            "optax.MultiSteps step that did not compute the loss):",
            "",
            table(header, history),
            "",
            "The prototype ran the inner step on every call and kept its result at the "
            "boundary only, as optax.MultiSteps does. Without donation it wrote "
            f"{EVERY_CALL_WRITTEN:.2f} P per window, where jaxaccum writes "
            f"{ours_nd['window_written'] / ours_nd['param_bytes']:.2f} P in this run: in it the "
            "boundary's passes (the division, the norm, the reset), kept apart for the numbers' "
            "order, ran on every call. Donated, it also wrote the inner state on every call.",
        ]
    )
