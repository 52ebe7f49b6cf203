"""Section 3's compiled micro-step programs: one per way of running data parallelism.

``pmap`` and ``shard_map`` (jaxaccum with ``axis_name`` against optax.MultiSteps
fed ``pmean``-ed gradients), plain ``jit`` on an Explicit mesh with the axis
name (unreduced window sums), and ``jit`` on batch-sharded global arrays
without it (XLA's partitioner places the reductions). ``comm`` reads their
all-reduces.
"""

from __future__ import annotations

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
    params = model.params
    local_batch = jax.tree.map(np.asarray, model.batch(rows, 0))
    stacked = lambda tree: jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), tree)
    value_and_grad = jax.value_and_grad(model.loss_fn, has_aux=True)
    mean_grad = jax.grad(mean_loss(model.loss_fn))
    out = {}

    # pmap
    ours = jaxaccum.multi_steps(inner(), k, axis_name=AXIS)
    # optax's code, run under JAX's standard promotion (tests are strict for ours)
    theirs = standard(optax.MultiSteps(inner(), k))

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
    jit_step, jit_args = explicit_jit_step(model, explicit, inner, k, rows)
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
