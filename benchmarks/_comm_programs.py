"""Section 3's compiled micro-step programs: one per way of running data parallelism.

``pmap`` and ``shard_map`` (jaxaccum with ``axis_name`` against optax.MultiSteps
fed ``pmean``-ed gradients), plain ``jit`` on an Explicit mesh with the axis
name (unreduced window sums), and ``jit`` on batch-sharded global arrays
without it (XLA's partitioner places the reductions). ``comm`` reads their
all-reduces.
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
from benchmarks._models import Model, mean_loss
from testkit import standard

AXIS = "data"


def programs(model: Model, k: int, devices: list, rows: int) -> dict[str, tuple[str, bool]]:
    """Compiled HLO text of each micro-step program -> (text, accumulating?)."""
    n = len(devices)
    inner = lambda: optax.adamw(1e-4)
    mesh = jax.sharding.Mesh(np.asarray(devices), (AXIS,))
    local_batch = jax.tree.map(np.asarray, model.batch(rows, 0))
    global_batch = jax.tree.map(lambda x: np.concatenate([x] * n), local_batch)
    ours = jaxaccum.multi_steps(inner(), k, axis_name=AXIS)
    # optax's code, run under JAX's standard promotion (tests are strict for ours)
    theirs = standard(optax.MultiSteps(inner(), k))
    out = _pmap_programs(
        _steps(model, ours, theirs, varying=False), model.params, local_batch, devices
    )
    out |= _shard_map_programs(
        _steps(model, ours, theirs, varying=True), model.params, global_batch, mesh
    )
    # plain jit on an Explicit mesh with the axis name: unreduced window sums
    explicit = jax.make_mesh((n,), (AXIS,), devices=devices)  # Explicit axes: the default
    jit_step, jit_args = explicit_jit_step(model, explicit, inner, k, rows)
    out["jaxaccum, jit on an Explicit mesh (axis name)"] = (
        jit_step.lower(*jit_args).compile().as_text(),
        True,
    )
    # jit on sharded global arrays, no axis name: the partitioner decides (GSPMD)
    plain = jaxaccum.multi_steps(inner(), k)
    out["jaxaccum, jit without axis name (GSPMD)"] = (
        _gspmd_program(model, plain, global_batch, mesh),
        True,
    )
    return out


def _steps(model: Model, ours, theirs, *, varying: bool) -> dict[str, tuple[Any, Any, bool]]:
    """``{name: (tx, micro-step, accumulating?)}``: jaxaccum's and optax.MultiSteps' (fed
    ``pmean``-ed gradients); ``varying``: under ``shard_map``, the parameters made per-device
    first (per-device gradients, no autodiff psum)."""
    value_and_grad = jax.value_and_grad(model.loss_fn, has_aux=True)
    mean_grad = jax.grad(mean_loss(model.loss_fn))
    local = (lambda p: jax.lax.pcast(p, AXIS, to="varying")) if varying else (lambda p: p)

    def ours_step(p, s, b):
        (loss_sum, num_items), g = value_and_grad(local(p), b)
        u, s = ours.update(g, s, p, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(p, u), s

    def theirs_step(p, s, b):
        g = jax.lax.pmean(mean_grad(local(p), b), AXIS)
        u, s = theirs.update(g, s, p)
        return optax.apply_updates(p, u), s

    return {
        "jaxaccum": (ours, ours_step, True),
        "optax.MultiSteps + pmean": (theirs, theirs_step, False),
    }


def _pmap_programs(steps: dict, params: Any, local_batch: Any, devices: list) -> dict:
    """Each step under ``pmap`` over ``devices``, compiled."""
    n = len(devices)
    stacked = lambda tree: jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), tree)
    out = {}
    for name, (tx, step, acc) in steps.items():
        init = jax.pmap(tx.init, axis_name=AXIS, devices=devices)
        p = stacked(params)
        s = jax.eval_shape(init, p)
        fn = jax.pmap(step, axis_name=AXIS, devices=devices)
        out[f"{name}, pmap"] = (fn.lower(p, s, stacked(local_batch)).compile().as_text(), acc)
    return out


def _shard_map_programs(steps: dict, params: Any, global_batch: Any, mesh) -> dict:
    """Each step under ``shard_map`` over ``mesh`` (jaxaccum's state laid out by
    ``partition_specs``, optax.MultiSteps' replicated), compiled."""
    batch_spec = jax.tree.map(lambda _: P(AXIS), global_batch)
    global_batch = jax.device_put(global_batch, NamedSharding(mesh, P(AXIS)))
    replicated_params = jax.device_put(params, NamedSharding(mesh, P()))
    out = {}
    for name, (tx, step, acc) in steps.items():
        shape = jax.eval_shape(tx.init, params)
        specs = jaxaccum.partition_specs(shape, AXIS) if acc else jax.tree.map(lambda _: P(), shape)
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
    return out


def _gspmd_program(model: Model, tx, global_batch: Any, mesh) -> str:
    """jaxaccum without an axis name under ``jit``, on batch-sharded global arrays, compiled."""
    value_and_grad = jax.value_and_grad(model.loss_fn, has_aux=True)
    params = jax.device_put(model.params, NamedSharding(mesh, P()))
    s = jax.device_put(tx.init(model.params), NamedSharding(mesh, P()))

    def plain_step(p, s, b):
        (loss_sum, num_items), g = value_and_grad(p, b)
        u, s = tx.update(g, s, p, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(p, u), s

    batch = jax.device_put(global_batch, NamedSharding(mesh, P(AXIS)))
    return jax.jit(plain_step).lower(params, s, batch).compile().as_text()


def explicit_jit_step(model: Model, mesh, inner, k: int, rows: int, axis_name: str | None = AXIS):
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
