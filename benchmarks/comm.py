"""3. Communication: gradient all-reduces per window.

JAX, read off the compiled programs (static counts, no timing): the
all-reduce instructions of one micro-step program and where they sit. A
window runs the program ``k`` times; between boundaries a call takes the
entry computation only (jaxaccum's boundary loop makes zero trips), the call
that closes the window also makes the loop's one trip. So::

    per window = (k - 1) * (all-reduces on a micro-step's path)
                 + (all-reduces on the boundary's path)

for ``jaxaccum.multi_steps(..., axis_name=...)`` (target: 1) against
``optax.MultiSteps`` fed ``pmean``-ed gradients (``k``), under ``pmap`` and
``shard_map``; ``jaxaccum.multi_steps(..., axis_name=...)`` under plain
``jit`` on an Explicit mesh (unreduced window sums, target 1); and without an
axis name under ``jit`` on batch-sharded global arrays, where XLA's
partitioner places the reductions (``k``). Plus the per-window time of the two
``jit`` variants, interleaved (informative on CPU).

PyTorch, counted at run time by a DDP communication hook
(``parity_tests.torch_scenario.Scenario(count_comm=True)``): gradient bucket all-reduces per
window for torch_ref (``no_sync()`` around forward and backward of all but
the last micro-batch) and for its ``no_sync_backward_only`` bug.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from benchmarks import _comm_programs, _common
from benchmarks._comm_programs import AXIS
from benchmarks._common import Section, table
from benchmarks._models import Model
from testkit import hlo

ROLES = ("entry", "loop", "repeated", "branch_small", "branch_large")  # testkit.hlo's


def jit_time_ratio(model: Model, *, k: int, devices: list, rows: int, rounds: int) -> dict:
    """Per-window time, jit with the axis name (1 all-reduce) over jit without (k), both on
    one Explicit mesh, donated (the counted GSPMD program is on an Auto mesh: the same k)."""
    mesh = jax.make_mesh((len(devices),), (AXIS,), devices=devices)
    inner = lambda: optax.adamw(1e-4)
    runs = {}
    for label, axis_name in (("with axis name", AXIS), ("without axis name", None)):
        step, (params, state, batch) = _comm_programs.explicit_jit_step(
            model, mesh, inner, k, rows, axis_name
        )
        live = {"params": params, "state": state}

        def window(step=step, live=live, batch=batch):
            for _ in range(k):
                live["params"], live["state"] = step(live["params"], live["state"], batch)
            return live["params"]

        runs[label] = window
    timings = _common.interleaved(runs, rounds)
    ours, theirs = timings["with axis name"], timings["without axis name"]
    return {
        "ratio_wall": _common.paired_ratio(ours.walls, theirs.walls),
        "ratio_cpu": _common.paired_ratio(ours.cpus, theirs.cpus),
        "spread_wall": _common.paired_spread(ours.walls, theirs.walls),
        "window_wall": (ours.wall, theirs.wall),
    }


def jax_counts(model: Model, *, k: int, devices: list, rows: int = 2) -> list[dict[str, Any]]:
    """All-reduce counts and bytes per micro-step path, boundary path and window; and every
    other collective (``hlo.COLLECTIVES``: reduce-scatter, all-gather, all-to-all,
    collective-permute) per window, which "1 all-reduce per window" and "k" need at 0."""
    results = []
    for name, (text, acc) in _comm_programs.programs(model, k, devices, rows).items():
        every = hlo.collectives(text)
        found = [c for c in every if c["op"] == "all-reduce"]
        others = [c for c in every if c["op"] != "all-reduce"]
        count, size = (
            hlo.per_window(found, k=k, accumulating=acc, field=field)
            for field in ("count", "bytes")
        )
        other = hlo.per_window(others, k=k, accumulating=acc, field="count")
        where = {role: sum(c["where"] == role for c in found) for role in ROLES}
        results.append(
            {
                "name": name,
                "instructions": len(found),
                "where": ", ".join(f"{r}: {n}" for r, n in where.items() if n) or "-",
                "micro_step": count["micro_step"],
                "boundary": count["boundary"],
                "per_window": count["window"],
                "bytes_per_window": size["window"],
                "other_kinds": ", ".join(sorted({c["op"] for c in others})) or "-",
                "other_per_window": other["window"],
            }
        )
    return results


def torch_counts(
    *, k: int, world: int = 2, windows: int = 2, timeout_s: float = 240.0
) -> list[dict[str, Any]]:
    """DDP gradient all-reduces per window: torch_ref vs its no_sync_backward_only bug."""
    from parity_tests.torch_ranks import run_scenarios
    from parity_tests.torch_scenario import Scenario, split_window
    from tinygpt import TinyGPTConfig
    from tinygpt.torch_gpt import TinyGPT, export_state_dict
    from tinygpt.torch_testing import skewed_batch

    config = TinyGPTConfig(block_size=48)
    weights = export_state_dict(TinyGPT(config, seed=0))
    lengths = (2, 47, 0, 30, 1, 20, 40, 9)  # valid labels per sample (skewed, one empty)
    valid = tuple(lengths[i % len(lengths)] for i in range(2 * world * k))
    wins = [split_window(*skewed_batch(seed, valid), world, k) for seed in range(windows)]
    scenarios = [
        Scenario(config=config, weights=weights, windows=wins, count_comm=True, bug=bug)
        for bug in (None, "no_sync_backward_only")
    ]
    results = []
    for bug, res in zip(
        (None, "no_sync_backward_only"),
        run_scenarios(scenarios, timeout_s=timeout_s),
        strict=False,
    ):
        buckets = [c["allreduce_buckets"] for c in res.comm]
        synced = [c["synced_backwards"] for c in res.comm]
        results.append(
            {
                "name": "torch_ref (no_sync around forward and backward)"
                if bug is None
                else "torch_ref bug: no_sync_backward_only",
                "per_window": float(np.median(buckets)),
                "synced_backwards": float(np.median(synced)),
                "world": world,
            }
        )
    return results


def run(
    model: Model,
    *,
    k: int = 4,
    devices: list | None = None,
    torch: bool = True,
    rows: int = 2,
    rounds: int = 5,
) -> Section:
    """The communication section (JAX compiled counts, optional torch DDP counts)."""
    devices = devices or jax.devices("cpu")[:8]
    jax_results = jax_counts(model, k=k, devices=devices, rows=rows)
    timing = jit_time_ratio(model, k=k, devices=devices, rows=rows, rounds=rounds)
    torch_results = torch_counts(k=k) if torch else []
    body = [
        f"{model.name}, {len(devices)} (CPU) devices, k = {k}. Static counts from the compiled "
        "micro-step program: all-reduce instructions, the computation each sits in (entry: every "
        "call; loop: jaxaccum's boundary loop, one trip per window; repeated: any other loop, "
        "every call), those on a micro-step's path and on the boundary's path, and per window "
        "= (k - 1) x micro-step + boundary; then every other collective (reduce-scatter, "
        "all-gather, all-to-all, collective-permute) per window, counted the same way.",
        "",
        jax_counts_table(jax_results),
        "",
        jit_prose(jax_results, timing, devices),
    ]
    if torch_results:
        body += ["", torch_counts_prose(torch_results, k)]
    return Section(
        "3. Communication: all-reduces per window",
        "\n".join(body),
        _summary(jax_results, torch_results, timing, k=k, n_devices=len(devices)),
        {"jax": jax_results, "torch": torch_results},
    )


def jax_counts_table(jax_results: list[dict[str, Any]]) -> str:
    """The compiled programs' all-reduces: where they sit, per path and per window."""
    rows = [
        [
            r["name"],
            r["instructions"],
            r["where"],
            r["micro_step"],
            r["boundary"],
            r["per_window"],
            f"{r['bytes_per_window'] / 2**20:.2f}",
            f"{r['other_per_window']} ({r['other_kinds']})",
        ]
        for r in jax_results
    ]
    header = [
        "program",
        "all-reduces in HLO",
        "where",
        "on a micro-step",
        "at the boundary",
        "per window",
        "MiB all-reduced per window",
        "other collectives per window",
    ]
    return table(header, rows)


def jit_prose(jax_results: list[dict[str, Any]], timing: dict, devices: list) -> str:
    """Plain jit with the axis name (unreduced sums) against without it (GSPMD), and their time."""
    gspmd = next(r for r in jax_results if "GSPMD" in r["name"])
    explicit = next(r for r in jax_results if "Explicit" in r["name"])
    mib = lambda r: f"{r['bytes_per_window'] / 2**20:.2f} MiB"
    counts = lambda r: (
        f"{r['micro_step']} on a micro-step's path, {r['boundary']} at the boundary, "
        f"{r['per_window']} per window, {mib(r)}"
    )
    return "\n".join(
        [
            f"Under plain `jit` on an Explicit mesh with `axis_name`, each device keeps its "
            f"partial sums in its own row between calls and the boundary all-reduces them ({counts(explicit)}"
            + (
                ": the gradient, the loss and the items in one"
                if explicit["per_window"] == 1
                else ""
            )
            + "). Without the axis name the state's `grad_sum` is replicated and XLA's partitioner "
            f"places the all-reduces ({counts(gspmd)}); the update is the same "
            "(`jaxaccum/_equivalence_test.py` checks it).",
            "",
            f"Per-window time on these {len(devices)} devices, jit with the axis name over jit "
            f"without: {timing['ratio_wall']:.2f} wall-clock [rounds {timing['spread_wall']}] "
            f"({1e3 * timing['window_wall'][0]:.1f} ms vs {1e3 * timing['window_wall'][1]:.1f} ms), "
            f"{timing['ratio_cpu']:.2f} in CPU time. Informative only: these are "
            f"{devices[0].platform.upper()} devices of one host, sharing its cores and memory; no "
            "section of this report times an all-reduce over a real interconnect.",
        ]
    )


def torch_counts_prose(torch_results: list[dict[str, Any]], k: int) -> str:
    """DDP's gradient bucket all-reduces per window, torch_ref against its bug."""
    return "\n".join(
        [
            f"PyTorch DDP, {torch_results[0]['world']} ranks on the CPU (gloo), tiny GPT, "
            f"k = {k}, counted by a DDP communication hook (median over windows; the hook sees "
            "DDP's gradient buckets only, not torch_ref's own all-reduces of a few scalars, "
            "`sum_over_ranks`):",
            "",
            table(
                ["run", "gradient bucket all-reduces per window", "backwards that synced"],
                [[r["name"], r["per_window"], r["synced_backwards"]] for r in torch_results],
            ),
        ]
    )


def _summary(
    jax_results: list[dict], torch_results: list[dict], timing: dict, *, k: int, n_devices: int
) -> list[tuple[str, str, str, bool | None]]:
    """The time ratio (informative), then all-reduces per window against 1 (ours) or k, met
    only with no other collective."""
    summary = [
        (
            f"per window, jit with axis name / jit without (the partitioner reduces every"
            f" micro-step), one Explicit mesh, {n_devices} CPU devices",
            f"{timing['ratio_wall']:.2f} [rounds {timing['spread_wall']}]",
            "(none; informative on CPU)",
            None,
        )
    ]
    for r in jax_results:
        if "GSPMD" in r["name"]:
            target, met = f"{k} (informative: the partitioner's)", r["per_window"] == k
        else:
            target = "1" if r["name"].startswith("jaxaccum") else str(k)
            met = r["per_window"] == int(target)
        value = str(r["per_window"])
        if r["other_per_window"]:
            value += f" (and {r['other_per_window']} {r['other_kinds']})"
        met = met and r["other_per_window"] == 0
        summary.append((f"gradient all-reduces per window, {r['name']}", value, target, met))
    for r in torch_results:
        target = "1" if "bug" not in r["name"] else str(k)
        summary.append(
            (
                f"gradient all-reduces per window, {r['name']}",
                f"{r['per_window']:g}",
                target,
                r["per_window"] == int(target),
            )
        )
    return summary
