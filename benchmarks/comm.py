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
(``torch_ref.Scenario(count_comm=True)``): gradient bucket all-reduces per
window for torch_ref (``no_sync()`` around forward and backward of all but
the last micro-batch) and for its ``no_sync_backward_only`` bug.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from benchmarks._common import Section, all_reduces, on_paths, table
from benchmarks._models import Model, mean_loss

AXIS = "data"


def _programs(model: Model, k: int, devices: list, rows: int) -> dict[str, tuple[str, bool]]:
    """Compiled HLO text of each micro-step program -> (text, accumulating?)."""
    n = len(devices)
    inner = lambda: optax.adamw(1e-4)
    params = model.params
    local_batch = jax.tree.map(np.asarray, model.batch(rows, 0))
    stacked = lambda tree: jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), tree)
    value_and_grad = jax.value_and_grad(model.loss_fn, has_aux=True)
    mean_grad = jax.grad(mean_loss(model.loss_fn))
    out = {}

    # pmap
    ours = jaxaccum.multi_steps(inner(), k, axis_name=AXIS)
    theirs = optax.MultiSteps(inner(), k)

    def ours_step(p, s, b):
        (loss_sum, num_items), g = value_and_grad(p, b)
        u, s = ours.update(g, s, p, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(p, u), s

    def theirs_step(p, s, b):
        g = jax.lax.pmean(mean_grad(p, b), AXIS)
        u, s = theirs.update(g, s, p)
        return optax.apply_updates(p, u), s

    for name, tx, step, acc in (
        ("jaxaccum", ours, ours_step, True),
        ("optax.MultiSteps + pmean", theirs, theirs_step, False),
    ):
        init = jax.pmap(tx.init, axis_name=AXIS, devices=devices)
        p = stacked(params)
        s = jax.eval_shape(init, p)
        fn = jax.pmap(step, axis_name=AXIS, devices=devices)
        out[f"{name}, pmap"] = (fn.lower(p, s, stacked(local_batch)).compile().as_text(), acc)

    # shard_map over a mesh of the same devices
    mesh = jax.sharding.Mesh(np.asarray(devices), (AXIS,))
    global_batch = jax.tree.map(lambda x: np.concatenate([x] * n), local_batch)
    batch_spec = jax.tree.map(lambda _: P(AXIS), global_batch)
    global_batch = jax.device_put(global_batch, NamedSharding(mesh, P(AXIS)))
    replicated_params = jax.device_put(params, NamedSharding(mesh, P()))

    def ours_sm(p, s, b):
        local = jax.lax.pcast(p, AXIS, to="varying")  # per-device gradients, no autodiff psum
        (loss_sum, num_items), g = value_and_grad(local, b)
        u, s = ours.update(g, s, p, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(p, u), s

    def theirs_sm(p, s, b):
        local = jax.lax.pcast(p, AXIS, to="varying")
        g = jax.lax.pmean(mean_grad(local, b), AXIS)
        u, s = theirs.update(g, s, p)
        return optax.apply_updates(p, u), s

    ours_specs = jaxaccum.partition_specs(jax.eval_shape(ours.init, params), AXIS)
    theirs_specs = jax.tree.map(lambda _: P(), jax.eval_shape(theirs.init, params))
    for name, tx, step, specs, acc in (
        ("jaxaccum", ours, ours_sm, ours_specs, True),
        ("optax.MultiSteps + pmean", theirs, theirs_sm, theirs_specs, False),
    ):
        s = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(replicated_params)
        fn = jax.jit(
            jax.shard_map(
                step, mesh=mesh, in_specs=(P(), specs, batch_spec), out_specs=(P(), specs)
            )
        )
        out[f"{name}, shard_map"] = (
            fn.lower(replicated_params, s, global_batch).compile().as_text(),
            acc,
        )

    # plain jit on an Explicit mesh with the axis name: unreduced window sums
    explicit = jax.make_mesh((n,), (AXIS,), devices=devices)  # Explicit axes: the default
    jit_step, jit_args = _explicit_jit_step(model, explicit, inner, k, rows)
    out["jaxaccum, jit on an Explicit mesh (axis name)"] = (
        jit_step.lower(*jit_args).compile().as_text(),
        True,
    )

    # jit on sharded global arrays, no axis name: the partitioner decides (GSPMD)
    plain = jaxaccum.multi_steps(inner(), k)
    s = jax.device_put(plain.init(params), NamedSharding(mesh, P()))

    def plain_step(p, s, b):
        (loss_sum, num_items), g = value_and_grad(p, b)
        u, s = plain.update(g, s, p, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(p, u), s

    out["jaxaccum, jit without axis name (GSPMD)"] = (
        jax.jit(plain_step).lower(replicated_params, s, global_batch).compile().as_text(),
        True,
    )
    return out


def _explicit_jit_step(model: Model, mesh, inner, k: int, rows: int, axis_name: str | None = AXIS):
    """The README's plain-jit micro-step on ``mesh`` and its first arguments.

    ``axis_name=None``: the same step without it (GSPMD reduces every micro-step).
    """
    tx = jaxaccum.multi_steps(inner(), k, axis_name=axis_name)
    grad_fn = (
        jaxaccum.value_and_grad(model.loss_fn, axis_name=axis_name)
        if axis_name
        else jax.value_and_grad(model.loss_fn, has_aux=True)
    )

    def step(p, s, b):
        (loss_sum, num_items), g = grad_fn(p, b)
        u, s = tx.update(g, s, p, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(p, u), s

    n = mesh.devices.size
    local = jax.tree.map(np.asarray, model.batch(rows, 0))
    with jax.set_mesh(mesh):
        params = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(jax.device_put(model.params, P()))
        state = jax.jit(tx.init)(params)  # fresh buffers: the step donates both
        batch = jax.device_put(jax.tree.map(lambda x: np.concatenate([x] * n), local), P(AXIS))
    jitted = jax.jit(step, donate_argnums=(0, 1))

    def under_mesh(*args):
        with jax.set_mesh(mesh):
            return jitted(*args)

    under_mesh.lower = lambda *a: _lower_under(mesh, jitted, *a)
    return under_mesh, (params, state, batch)


def _lower_under(mesh, jitted, *args):
    with jax.set_mesh(mesh):
        return jitted.lower(*args)


def jit_time_ratio(model: Model, *, k: int, devices: list, rows: int, rounds: int) -> dict:
    """Per-window time, jit with the axis name (1 all-reduce) over jit without (k)."""
    from benchmarks import _common

    mesh = jax.make_mesh((len(devices),), (AXIS,), devices=devices)
    inner = lambda: optax.adamw(1e-4)
    runs = {}
    for label, axis_name in (("with axis name", AXIS), ("without (GSPMD)", None)):
        step, (params, state, batch) = _explicit_jit_step(model, mesh, inner, k, rows, axis_name)
        live = {"params": params, "state": state}

        def window(step=step, live=live, batch=batch):
            for _ in range(k):
                live["params"], live["state"] = step(live["params"], live["state"], batch)
            return live["params"]

        runs[label] = window
    timings = _common.interleaved(runs, rounds)
    ours, theirs = timings["with axis name"], timings["without (GSPMD)"]
    return {
        "ratio_wall": _common.paired_ratio(ours.walls, theirs.walls),
        "ratio_cpu": _common.paired_ratio(ours.cpus, theirs.cpus),
        "spread_wall": _common.paired_spread(ours.walls, theirs.walls),
        "window_wall": (ours.wall, theirs.wall),
    }


def jax_counts(model: Model, *, k: int, devices: list, rows: int = 2) -> list[dict[str, Any]]:
    """All-reduce counts and bytes per micro-step path, boundary path and window."""
    results = []
    for name, (hlo, acc) in _programs(model, k, devices, rows).items():
        place = all_reduces(hlo)
        between, boundary = on_paths(place, "count", acc)
        b_between, b_boundary = on_paths(place, "bytes", acc)
        results.append(
            {
                "name": name,
                "instructions": sum(v["count"] for v in place.values()),
                "where": ", ".join(f"{r}: {v['count']}" for r, v in place.items() if v["count"])
                or "-",
                "micro_step": between,
                "boundary": boundary,
                "per_window": (k - 1) * between + boundary,
                "bytes_per_window": (k - 1) * b_between + b_boundary,
            }
        )
    return results


def torch_counts(
    *, k: int, world: int = 2, windows: int = 2, timeout_s: float = 240.0
) -> list[dict[str, Any]]:
    """DDP gradient all-reduces per window: torch_ref vs its no_sync_backward_only bug."""
    import torch_ref
    from torch_ref.testing import skewed_batch

    config = torch_ref.TinyGPTConfig(block_size=48)
    weights = torch_ref.export_state_dict(torch_ref.TinyGPT(config, seed=0))
    lengths = (2, 47, 0, 30, 1, 20, 40, 9)  # valid labels per sample (skewed, one empty)
    valid = tuple(lengths[i % len(lengths)] for i in range(2 * world * k))
    wins = [torch_ref.split_window(*skewed_batch(seed, valid), world, k) for seed in range(windows)]
    scenarios = [
        torch_ref.Scenario(config=config, weights=weights, windows=wins, count_comm=True, bug=bug)
        for bug in (None, "no_sync_backward_only")
    ]
    results = []
    for bug, res in zip(
        (None, "no_sync_backward_only"),
        torch_ref.run_scenarios(scenarios, timeout_s=timeout_s),
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
    rows_ = [
        [
            r["name"],
            r["instructions"],
            r["where"],
            r["micro_step"],
            r["boundary"],
            r["per_window"],
            f"{r['bytes_per_window'] / 2**20:.2f}",
        ]
        for r in jax_results
    ]
    body = [
        f"{model.name}, {len(devices)} (CPU) devices, k = {k}. Static counts from the compiled "
        "micro-step program: all-reduce instructions, the computation each sits in (entry: every "
        "call; while_body: jaxaccum's boundary loop, one trip per window), those on a micro-step's "
        "path and on the boundary's path, and per window = (k - 1) x micro-step + boundary.",
        "",
        table(
            [
                "program",
                "all-reduces in HLO",
                "where",
                "on a micro-step",
                "at the boundary",
                "per window",
                "MiB all-reduced per window",
            ],
            rows_,
        ),
    ]
    gspmd = next(r for r in jax_results if "GSPMD" in r["name"])
    explicit = next(r for r in jax_results if "Explicit" in r["name"])
    mib = lambda r: f"{r['bytes_per_window'] / 2**20:.2f} MiB"
    counts = lambda r: (
        f"{r['micro_step']} on a micro-step's path, {r['boundary']} at the boundary, "
        f"{r['per_window']} per window, {mib(r)}"
    )
    body += [
        "",
        f"Under plain `jit` on an Explicit mesh with `axis_name`, the window's sums stay "
        f"unreduced between calls and the boundary all-reduces them ({counts(explicit)}"
        + (": the gradient, the loss and the items in one" if explicit["per_window"] == 1 else "")
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
    if torch_results:
        body += [
            "",
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
    summary = [
        (
            f"per window, jit with axis name / jit without (GSPMD), {len(devices)} CPU devices",
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
        summary.append(
            (f"gradient all-reduces per window, {r['name']}", str(r["per_window"]), target, met)
        )
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
    return Section(
        "3. Communication: all-reduces per window",
        "\n".join(body),
        summary,
        {"jax": jax_results, "torch": torch_results},
    )
