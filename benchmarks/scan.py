"""2. In-step scan vs big batch: ``jaxaccum.accumulate_gradients`` over k.

Both programs are a full train step on the same global batch (gradient,
AdamW, ``apply_updates``; parameters and optimizer state donated):

* big batch: ``jax.grad`` of the batch's mean loss in one pass;
* accumulated: ``accumulate_gradients`` scans ``k`` micro-batches of
  ``global_rows / k`` rows (one micro-batch's activations alive at a time).

Figures: the time ratio accumulated / big batch (interleaved rounds, medians)
and the compiled executable's temporary memory
(``compiled.memory_analysis().temp_size_in_bytes``: activations and other
scratch; parameters, state and batch are arguments and not included).
"""

from __future__ import annotations

import jax
import optax

import jaxaccum
from benchmarks import _common
from benchmarks._common import Section, Timing, mib, ms, table
from benchmarks._models import Model, copy_tree, mean_loss, stack
from testkit import standard


class Program:
    """A compiled train step with its live buffers (donated between calls)."""

    def __init__(self, compiled, params, opt_state, batch):
        self.compiled, self.params, self.opt_state, self.batch = compiled, params, opt_state, batch

    def __call__(self):
        self.params, self.opt_state = self.compiled(self.params, self.opt_state, self.batch)
        return self.params


def build(model: Model, k: int | None, global_rows: int, seed: int = 0) -> Program:
    """The big-batch step (``k=None``) or the accumulated step over ``k`` micro-batches."""
    # optax's code, run under JAX's standard promotion (tests are strict for ours)
    tx = standard(optax.adamw(1e-4, weight_decay=0.01))
    params = copy_tree(model.params)
    opt_state = tx.init(params)
    if k is None:
        batch = model.batch(global_rows, seed)
        grad_fn = jax.grad(mean_loss(model.loss_fn))

        def step(params, opt_state, batch):
            updates, opt_state = tx.update(grad_fn(params, batch), opt_state, params)
            return optax.apply_updates(params, updates), opt_state

    else:
        if global_rows % k:
            raise ValueError(f"global_rows={global_rows} is not divisible by k={k}")
        full = model.batch(global_rows, seed)  # the same rows, cut into k micro-batches
        rows = global_rows // k
        batch = stack(
            [jax.tree.map(lambda x, i=i: x[i * rows : (i + 1) * rows], full) for i in range(k)]
        )

        def step(params, opt_state, microbatches):
            grads, _ = jaxaccum.accumulate_gradients(model.loss_fn, params, microbatches)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

    batch = jax.device_put(batch)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, batch).compile()
    return Program(compiled, params, opt_state, batch)


def _cores(results: list[dict]) -> str:
    """What the run says about cores: CPU time over wall time of each step."""
    cores = {r["name"]: r["cpu"] / r["wall"] for r in results}
    big = cores.pop("big batch")
    scans = f"{min(cores.values()):.2f} to {max(cores.values()):.2f}" if cores else "-"
    return (
        "CPU time above wall time means XLA ran the step on more than one core: CPU / wall was "
        f"{big:.2f} for the big batch and {scans} for the scanned steps. This run does not tell "
        "how much of a time ratio comes from the cores a step could use and how much from the "
        "scan's smaller working set."
    )


def run(
    model: Model,
    *,
    global_rows: int = 64,
    ks: tuple[int, ...] = (1, 2, 4, 8, 16),
    rounds: int = 5,
    target_k: int = 8,
) -> Section:
    """Times the big-batch step and the accumulated step for each ``k``."""
    programs = {"big batch": build(model, None, global_rows)}
    for k in ks:
        programs[f"k={k}"] = build(model, k, global_rows)
    results = against_big_batch(programs, _common.interleaved(programs, rounds))
    rows = [
        [
            r["name"],
            ms(r["wall"]),
            ms(r["cpu"]),
            f"{r['ratio_wall']:.2f}",
            f"{r['ratio_cpu']:.2f}",
            "n/a" if r["temp_bytes"] is None else mib(r["temp_bytes"]),
            "n/a" if r["temp_ratio"] is None else f"{r['temp_ratio']:.3f}",
        ]
        for r in results
    ]
    body = "\n".join(
        [
            f"{model.name}; global batch {global_rows} rows x {model.tokens_per_row} tokens, "
            "AdamW, parameters and optimizer state donated. Times in ms (medians over interleaved "
            "rounds); ratios against the big-batch step (median of the per-round ratios); temporary memory from "
            "`compiled.memory_analysis().temp_size_in_bytes`.",
            "",
            table(
                ["step", "wall", "CPU", "ratio wall", "ratio CPU", "temp MiB", "temp / big batch"],
                rows,
            ),
            "",
            _cores(results),
        ]
    )
    return Section(
        "2. In-step scan vs big batch: jaxaccum.accumulate_gradients",
        body,
        _summary(results, target_k),
        {"results": results},
    )


def against_big_batch(programs: dict[str, Program], timings: dict[str, Timing]) -> list[dict]:
    """Each step's times and temporary memory, and their ratios to the big-batch step's."""
    big = timings["big batch"]
    big_temp = _common.temp_bytes(programs["big batch"].compiled)
    results = []
    for name, program in programs.items():
        t = timings[name]
        temp = _common.temp_bytes(program.compiled)
        results.append(
            {
                "name": name,
                "k": None if name == "big batch" else int(name[2:]),
                "wall": t.wall,
                "cpu": t.cpu,
                "ratio_wall": _common.paired_ratio(t.walls, big.walls),
                "ratio_cpu": _common.paired_ratio(t.cpus, big.cpus),
                "spread_cpu": _common.paired_spread(t.cpus, big.cpus),
                "temp_bytes": temp,
                "temp_ratio": None if temp is None or not big_temp else temp / big_temp,
            }
        )
    return results


def _summary(results: list[dict], target_k: int) -> list[tuple[str, str, str, bool | None]]:
    """At ``target_k``: the time ratio (target <= 1.15) and the memory ratio (~ 1/k)."""
    at = next((r for r in results if r["k"] == target_k), None)
    if at is None:
        return []
    summary = [
        (
            f"in-step scan / big batch, time, k={target_k} (CPU time)",
            f"{at['ratio_cpu']:.2f} [rounds {at['spread_cpu']}] (wall {at['ratio_wall']:.2f})",
            "<= 1.15",
            at["ratio_cpu"] <= 1.15,
        )
    ]
    if at["temp_ratio"] is not None:
        summary.append(
            (
                f"in-step scan / big batch, temporary memory, k={target_k}",
                f"{at['temp_ratio']:.3f}",
                f"~ 1/{target_k} = {1 / target_k:.3f} (activations)",
                at["temp_ratio"] <= 2.0 / target_k,
            )
        )
    return summary
