"""`testkit.hlo` places a conditional of the inner optimizer where it runs: in the boundary.

A ``lax.cond`` in the inner update sits in jaxaccum's window-close loop, which runs once per
window; its branches take the loop's role, so a micro-step counts none of it (the
branch-by-size roles are for a conditional of the entry: optax.MultiSteps' skip).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import jaxaccum
from testkit import hlo

K = 4


def cond_scale() -> optax.GradientTransformation:
    """Updates through a data-dependent ``lax.cond`` (its count's parity picks a branch)."""

    def update(updates, count, params=None):
        big = lambda u: jax.tree.map(lambda x: jnp.tanh(x) * 0.5 + jnp.sin(x) * 0.1, u)
        small = lambda u: jax.tree.map(lambda x: -x, u)
        return jax.lax.cond(count % 2 == 0, big, small, updates), count + 1

    return optax.GradientTransformation(lambda p: jnp.zeros((), jnp.int32), update)


def compiled_step(inner: optax.GradientTransformation) -> str:
    """The compiled, donated micro-step of ``multi_steps(inner, K)`` on a small regression."""
    tx = jaxaccum.multi_steps(inner, K)
    params = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
    x, y = jnp.ones((2, 8)), jnp.ones((2, 4))

    def step(p, s):
        loss = lambda p: (jnp.sum((x @ p["w"] + p["b"][None] - y) ** 2), 2.0)
        (loss_sum, n), g = jax.value_and_grad(loss, has_aux=True)(p)
        u, s = tx.update(g, s, p, num_items=n, loss_sum=loss_sum)
        return optax.apply_updates(p, u), s

    jitted = jax.jit(step, donate_argnums=(0, 1))
    return jitted.lower(params, tx.init(params)).compile().as_text()


def test_a_conditional_of_the_inner_update_runs_in_the_boundary_only():
    plain = hlo.operations(compiled_step(optax.sgd(0.1)))
    with_cond = hlo.operations(compiled_step(optax.chain(optax.sgd(0.1), cond_scale())))
    assert {o["where"] for o in with_cond} == {"entry", "loop"}, with_cond
    per_window = lambda ops: hlo.per_window(ops, k=K, accumulating=True, field="count")
    # a micro-step: the same operations with or without the cond (it is the boundary's)
    assert per_window(with_cond)["micro_step"] == per_window(plain)["micro_step"]
    assert per_window(with_cond)["boundary"] > per_window(plain)["boundary"]


def test_a_collective_in_either_branch_of_an_entry_conditional_counts_on_every_call():
    # a jaxaccum program may take either branch of a conditional on any call: both count
    # (a count never lower than what runs); here a psum in the larger branch
    mesh = jax.make_mesh((2,), ("b",), devices=jax.devices()[:2])
    P = jax.sharding.PartitionSpec

    def body(x, pred):
        summed = lambda x: jax.lax.pcast(jax.lax.psum(jnp.sin(x) * 2 + 1, "b"), "b", to="varying")
        return jax.lax.cond(pred, lambda x: x, summed, x)

    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("b"), P()), out_specs=P("b")))
    x = jax.device_put(jnp.ones(8), jax.NamedSharding(mesh, P("b")))
    found = hlo.collectives(mapped.lower(x, True).compile().as_text())
    assert [c["op"] for c in found] == ["all-reduce"], found
    counts = hlo.per_window(found, k=K, accumulating=True, field="count")
    assert counts == {"micro_step": 1, "boundary": 1, "window": K}
