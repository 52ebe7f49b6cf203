"""Between boundaries no collective runs: read off the compiled programs of each mode.

Every kind of collective is read (``testkit.hlo.COLLECTIVES``: all-reduce, reduce-scatter,
all-gather, all-to-all, collective-permute, their ``-start`` forms), and where it runs:
``loop`` (jaxaccum's boundary, once per window), ``entry`` and ``repeated`` (any other
loop's body) on every call. The controls build the regressions the counter must see.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._sharding import varying_axes
from testkit import data_parallel, tiny_lm_loss, tiny_lm_params
from testkit.hlo import collectives, per_window

DEVICES = 4
MICRO_BATCH = 2
SEQ_LEN = 10


def zeros_batch(*leading):
    zeros = np.zeros(leading + (MICRO_BATCH, SEQ_LEN), np.int32)
    return {"tokens": zeros, "labels": zeros}


K = 4


def compiled_collectives(tx_fn, mode: str) -> list[dict]:
    """The collectives of the tiny LM's micro-step with ``tx_fn(axis)``, compiled in ``mode``."""
    run = data_parallel(tx_fn, tiny_lm_loss, mode, DEVICES)
    params, state = run.init(tiny_lm_params())
    return collectives(run.hlo(params, state, zeros_batch(DEVICES)))


def ours(axis):
    return jaxaccum.multi_steps(optax.adamw(1e-3), K, axis_name=axis)


@pytest.mark.parametrize("mode", ["shard_map", "jit", "pmap"])
@pytest.mark.slow  # compiles a model or a multi-device program (> 1 s): make test, not test-fast
def test_one_all_reduce_per_window_in_the_boundary_loop(mode):
    found = compiled_collectives(ours, mode)
    # exactly one collective, an all-reduce (the gradient sums, the loss and the items
    # travel together), none on the micro-step path and no other kind: it sits in the
    # body of the boundary loop, which runs once when the window closes, never between
    assert [(c["op"], c["where"], c["trips"]) for c in found] == [("all-reduce", "loop", 1)]
    assert per_window(found, k=K, accumulating=True, field="count") == {
        "micro_step": 0, "boundary": 1, "window": 1}  # fmt: skip


def reduced_on_every_call(axis):
    """The red team's regression (``reduce_every_step_in_loop``): the gradient ``pmean``-ed
    on every call inside a zero-or-one-trip loop, jaxaccum's own kind, whose predicate is
    read from the state (``micro_step >= 0``: true on every call), then accumulated."""
    tx = ours(axis)

    def update(grads, state, params=None, **extra):
        def mean(g):  # as varying as it came (shard_map), for the loop's carry
            reduced = jax.lax.pmean(g, axis)
            return jax.lax.pcast(reduced, axis, to="varying") if varying_axes(g) else reduced

        every_call = state.micro_step >= 0
        trip = lambda carry: (jnp.zeros((), jnp.bool_), jax.tree.map(mean, carry[1]))
        _, grads = jax.lax.while_loop(lambda carry: carry[0], trip, (every_call, grads))
        return tx.update(grads, state, params, **extra)

    return optax.GradientTransformationExtraArgs(tx.init, update)


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
@pytest.mark.slow
def test_a_reduction_in_a_loop_on_every_call_counts_on_every_micro_step(mode):
    # the control: two zero-or-one-trip loops, the window's close (it holds the inner
    # update's loop) and the regression's, which runs on every call: its all-reduce is
    # on every micro-step's path, k + 1 per window with the boundary's
    found = compiled_collectives(reduced_on_every_call, mode)
    assert sorted((c["op"], c["where"]) for c in found) == [
        ("all-reduce", "loop"), ("all-reduce", "repeated")]  # fmt: skip
    assert per_window(found, k=K, accumulating=True, field="count") == {
        "micro_step": 1, "boundary": 2, "window": K + 1}  # fmt: skip


def scan_collectives(loss_of_params, params, batch, spec):
    mesh = jax.make_mesh((DEVICES,), ("data",))
    fn = jax.jit(
        jax.shard_map(loss_of_params, mesh=mesh, in_specs=(P(), spec), out_specs=(P(), P()))
    )
    batch = jax.device_put(batch, NamedSharding(mesh, spec))
    return collectives(fn.lower(params, batch).compile().as_text())


@pytest.mark.slow
def test_in_step_scan_has_as_many_all_reduces_as_one_big_batch_step():
    params, k = tiny_lm_params(), 8
    micro = jax.tree.map(lambda x: x.reshape(k, DEVICES * MICRO_BATCH, SEQ_LEN),
                         zeros_batch(k, DEVICES))  # fmt: skip
    big = jax.tree.map(lambda x: x.reshape(DEVICES * MICRO_BATCH, SEQ_LEN), zeros_batch(DEVICES))

    def accumulated(params, microbatches):
        grads, metrics = jaxaccum.accumulate_gradients(
            tiny_lm_loss, params, microbatches, axis_name="data"
        )
        return grads, metrics["loss"]

    def naive_scan(params, microbatches):
        # differentiating w.r.t. replicated params: JAX psums every micro-batch
        def body(carry, mb):
            grads = jax.grad(lambda p: tiny_lm_loss(p, mb)[0])(params)
            return jax.tree.map(jnp.add, carry, grads), None

        grads, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), microbatches)
        return grads, jnp.zeros(())

    scan = scan_collectives(accumulated, params, micro, P(None, "data"))
    one = scan_collectives(lambda p, b: accumulated(p, jax.tree.map(lambda x: x[None], b)),
                           params, big, P("data"))  # fmt: skip
    naive = scan_collectives(naive_scan, params, micro, P(None, "data"))
    # the scan: one all-reduce after it, like one big-batch step; none per micro-batch
    assert [c["where"] for c in scan] == [c["where"] for c in one] == ["entry"]
    # the control: a collective inside the scan's body, run on every call, k times
    assert [(c["where"], c["trips"]) for c in naive] == [("repeated", k)]
