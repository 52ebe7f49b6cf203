"""1. Per-micro-step cost: ``jaxaccum.multi_steps`` vs ``optax.MultiSteps``.

One jitted train step per micro-batch (forward, backward, ``tx.update``,
``optax.apply_updates``), the same inner optimizer, ``k`` micro-steps per
window, with the step's ``params`` and optimizer state donated or not. Both
steps compute the loss a training loop logs: optax.MultiSteps' step returns the
micro-batch's mean loss, jaxaccum's passes the summed loss to ``update``, which
keeps the window's mean loss in its record.

``optax.MultiSteps`` runs its inner optimizer on every micro-step and keeps
the result only at the boundary; ``jaxaccum.multi_steps`` runs it only at the
boundary, inside a ``lax.while_loop`` that makes one trip at a boundary and
zero trips in between. The compiled programs tell why the two differ: the ``copy`` instructions XLA inserts, counted here for
arrays shaped like the parameters, on the path a micro-step takes between
boundaries and on the boundary's path.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Callable
from typing import Any

import jax
import optax

import jaxaccum
from benchmarks import _common, _copy_analysis
from benchmarks._common import Section, ms, table, tree_bytes
from benchmarks._models import Model, copy_tree, mean_loss
from testkit import standard

BASELINE = "optax.MultiSteps"
INNERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adamw": lambda: optax.adamw(1e-4, weight_decay=0.01),
    # heavier: AdamW moments plus a per-leaf trust ratio (two norms per leaf)
    "lamb": lambda: optax.lamb(1e-4, weight_decay=0.01),
}


@dataclasses.dataclass
class Variant:
    """One compiled train step, its live buffers and its per-call timings."""

    label: str  # "jaxaccum" or "optax.MultiSteps"
    step: Any  # the compiled executable
    params: Any
    state: Any
    batches: list[Any]
    hlo: str
    calls: list[list[tuple[float, float]]] = dataclasses.field(default_factory=list)
    faults: list[int] = dataclasses.field(default_factory=list)  # minor page faults, per window

    def window(self) -> Any:
        """Runs one window (k calls, each blocked on), recording each call's time and the
        window's minor page faults."""
        times = []
        faults_before = _minor_faults()
        for batch in self.batches:
            t0, c0 = time.perf_counter(), time.process_time()
            outputs = self.step(self.params, self.state, batch)  # optax's adds the loss
            jax.block_until_ready(outputs)
            self.params, self.state = outputs[:2]
            times.append((time.perf_counter() - t0, time.process_time() - c0))
        self.calls.append(times)
        self.faults.append(_minor_faults() - faults_before)
        return self.params


def _minor_faults() -> int:
    """The process's minor page faults so far (pages mapped in at their first touch)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def build(model: Model, label: str, inner: str, donate: bool, k: int, rows: int) -> Variant:
    """Compiles one variant's train step (ahead of time) and its initial state."""
    tx_inner = INNERS[inner]()
    if label == BASELINE:
        # optax's code, run under JAX's standard promotion (tests are strict for ours)
        tx = standard(optax.MultiSteps(tx_inner, every_k_schedule=k))
        value_and_grad = jax.value_and_grad(mean_loss(model.loss_fn))

        def step(params, state, batch):  # returns the loss: the training loop logs it
            loss, grads = value_and_grad(params, batch)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

    else:
        tx = jaxaccum.multi_steps(tx_inner, every_k_schedule=k)
        value_and_grad = jax.value_and_grad(model.loss_fn, has_aux=True)

        def step(params, state, batch):  # the loss goes to the window record, in the state
            (loss_sum, num_items), grads = value_and_grad(params, batch)
            updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
            return optax.apply_updates(params, updates), state

    params = copy_tree(model.params)
    state = tx.init(params)
    batches = [jax.device_put(model.batch(rows, seed)) for seed in range(k)]
    jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    compiled = jitted.lower(params, state, batches[0]).compile()
    return Variant(label, compiled, params, state, batches, compiled.as_text())


@dataclasses.dataclass(frozen=True)
class Case:
    """One comparison: a model, an inner optimizer, the variants, the micro-batch rows."""

    model: Model
    inner: str = "adamw"
    labels: tuple[str, ...] = ("jaxaccum", BASELINE)
    rows: int = 8
    donation: tuple[bool, ...] = (True, False)


def run(cases: list[Case], *, ks: tuple[int, ...] = (4,), rounds: int = 5) -> Section:
    """Times every case, donated and not, for every window size, and reads the HLO.

    Args:
      cases: the comparisons (``optax.MultiSteps`` must be among each case's labels:
        it is the baseline of the ratios).
      ks: micro-steps per window, one comparison each; the copy analysis reads the
        window of 4 micro-steps when it is among them, else the first.
      rounds: interleaved measured rounds (medians).
    """
    results = [r for k in ks for r in _measured(cases, k, rounds)]
    _ratios(results)
    return _section(results, 4 if 4 in ks else ks[0])


def _measured(cases: list[Case], k: int, rounds: int) -> list[dict]:
    """Every case's variants, donated and not, at ``k`` micro-steps per window."""
    results = []
    for case in cases:
        for donate in case.donation:
            variants = [
                build(case.model, label, case.inner, donate, k, case.rows) for label in case.labels
            ]
            _common.interleaved({v.label: v.window for v in variants}, rounds)
            for v in variants:
                accumulating = v.label != BASELINE  # jaxaccum: its boundary loop once per window
                calls = v.calls[1:]  # the first window was the warm-up
                between = [c for w in calls for c in w[:-1]]
                boundary = [w[-1] for w in calls]
                windows = [(sum(c[0] for c in w), sum(c[1] for c in w)) for w in calls]
                nan = float("nan")
                results.append(
                    {
                        "model": case.model.name,
                        "k": k,
                        "inner": case.inner,
                        "donate": donate,
                        "label": v.label,
                        "between_wall": _common.median([c[0] for c in between]) if between else nan,
                        "between_cpu": _common.median([c[1] for c in between]) if between else nan,
                        "boundary_wall": _common.median([c[0] for c in boundary]),
                        "window_wall": _common.median([w[0] for w in windows]),
                        "window_cpu": _common.median([w[1] for w in windows]),
                        "param_bytes": tree_bytes(case.model.params),
                        "inner_bytes": tree_bytes(
                            jax.eval_shape(INNERS[case.inner]().init, case.model.params)
                        ),
                        "windows": windows,
                        "faults": v.faults[1:],  # the first window was the warm-up
                        "temp_bytes": _common.temp_bytes(v.step),
                        **_copy_analysis.copies(
                            v.hlo, case.model.params, k, accumulating=accumulating
                        ),
                        **_copy_analysis.operations(v.hlo, k, accumulating=accumulating),
                    }
                )
            del variants
    return results


def _ratios(results: list[dict]) -> None:
    """Each result's per-window ratios against the baseline of its model, optimizer,
    donation and window size (median of the per-round ratios, and their spread)."""
    same = ("model", "k", "inner", "donate")
    for r in results:
        base = next(
            b for b in results if b["label"] == BASELINE and all(b[f] == r[f] for f in same)
        )
        for i, clock in enumerate(("wall", "cpu")):
            ours, theirs = [w[i] for w in r["windows"]], [w[i] for w in base["windows"]]
            r[f"ratio_window_{clock}"] = _common.paired_ratio(ours, theirs)
            r[f"spread_window_{clock}"] = _common.paired_spread(ours, theirs)


def _section(results: list[dict], k: int) -> Section:
    """The table of every window size; the copy analysis and the optimizer's share at ``k``."""
    body = [
        "Times in ms, medians over interleaved rounds; 'micro-step' is a call between "
        "boundaries, 'boundary' the call that closes the window. Ratios: per window, against "
        "optax.MultiSteps with the same model, inner optimizer, donation and k (wall-clock "
        "and process CPU time; median of the per-round ratios). Both steps compute the loss "
        "a training loop logs: optax.MultiSteps' step returns it, jaxaccum's passes it to "
        "`update`, which records it. Copies: `copy` instructions "
        "of parameter-shaped arrays in the compiled program, on the path of a micro-step and "
        "of the boundary call (in parentheses: their bytes / the parameters' bytes). Page "
        "faults: the process's minor page faults in a window (median [rounds lo-hi]): glibc "
        "hands large freed buffers back to the system and a later call faults their pages in "
        "again, in some rounds and not others, which a timing counts; an accelerator's "
        "allocator keeps its buffers.",
        "",
        _table(results),
    ]
    at_k = [r for r in results if r["k"] == k]
    analysis, quoted = _copy_analysis.analysis(at_k, k)
    body += ["", _optimizer_share(at_k), "", analysis]
    body += ["", _copy_analysis.operations_table(results, k), "", _temporaries(at_k, k)]
    summary = [
        (
            f"per window, jaxaccum / optax.MultiSteps, {r['model'].split(' (')[0]}, "
            f"{r['inner']}, k={r['k']}, {'donated' if r['donate'] else 'not donated'} (CPU time)",
            f"{r['ratio_window_cpu']:.2f} [rounds {r['spread_window_cpu']}] "
            f"(wall {r['ratio_window_wall']:.2f})",
            "<= 1.0",
            r["ratio_window_cpu"] <= 1.0,
        )
        for r in results
        if r["label"] == "jaxaccum"
    ]
    return Section(
        "1. Per-micro-step cost: jaxaccum.multi_steps vs optax.MultiSteps",
        "\n".join(body),
        summary,
        {"results": results, "quoted": quoted},
    )


def _table(results: list[dict]) -> str:
    """One row per model, window size, optimizer, donation and variant."""
    per_p = lambda r, where: r[f"{where}_bytes"] / r["param_bytes"]
    rows = [
        [
            r["model"],
            str(r["k"]),
            r["inner"],
            "yes" if r["donate"] else "no",
            r["label"],
            ms(r["between_wall"]),
            ms(r["between_cpu"]),
            ms(r["boundary_wall"]),
            ms(r["window_wall"]),
            ms(r["window_cpu"]),
            f"{r['ratio_window_wall']:.2f}",
            f"{r['ratio_window_cpu']:.2f}",
            f"{r['between_copies']} ({per_p(r, 'between'):.1f}x)",
            f"{r['boundary_copies']} ({per_p(r, 'boundary'):.1f}x)",
            f"{_common.median(r['faults']):.0f} [{min(r['faults'])}-{max(r['faults'])}]",
        ]
        for r in results
    ]
    header = ["model", "k", "inner", "donated", "variant", "micro-step wall", "micro-step CPU",
              "boundary wall", "window wall", "window CPU", "ratio wall", "ratio CPU",
              "copies / micro-step", "copies / boundary", "page faults / window"]  # fmt: skip
    return table(header, rows)


def _temporaries(at_k: list[dict], k: int) -> str:
    """The temporary memory of each compiled step at ``k``, jaxaccum's next to optax's."""
    in_p = lambda r: (
        "n/a" if r["temp_bytes"] is None else f"{r['temp_bytes'] / r['param_bytes']:.2f} P"
    )
    pairs = _copy_analysis.pairs(at_k, k)
    rows = [[*_copy_analysis.case_cells(ours), in_p(ours), in_p(theirs)] for ours, theirs in pairs]
    header = ["model", "inner", "donated", "jaxaccum: temporaries", f"{BASELINE}: temporaries"]
    return "\n".join(
        [
            f"**Temporary memory** (k = {k}): the buffers XLA's buffer assignment gives a call "
            "besides its arguments and outputs (`memory_analysis()`), in P. At the boundary "
            "jaxaccum keeps the window gradient in the buffer that then receives the updates, "
            "so one parameter-sized temporary holds both (jaxaccum/_copies_test.py checks it; "
            "until 2026-12-03 they took two, 2.00 P with AdamW on the MLP, measured by this "
            "benchmark). LAMB holds one more of its own, the direction whose norm sets its "
            "trust ratio; the tiny GPT's temporaries are its activations.",
            "",
            table(header, rows),
        ]
    )


def _optimizer_share(results: list[dict]) -> str:
    """How much of a step the inner update is, per model, from jaxaccum's donated timings."""
    parts = [
        f"{r['boundary_wall'] / r['between_wall']:.2f}x for the {r['model'].split(' (')[0]}"
        for r in results
        if r["label"] == "jaxaccum" and r["donate"] and r["inner"] == "adamw"
    ]
    return (
        "jaxaccum's boundary call is a micro-step plus the inner update; its wall time over a "
        f"micro-step's: {', '.join(parts)}. The larger that factor, the more of a step is the "
        "inner optimizer's work, which optax.MultiSteps does on every call; the smaller, the "
        "more the ratios above measure the wrappers' fixed per-call costs."
    )
