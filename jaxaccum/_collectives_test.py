"""Between boundaries no collective runs: read off the compiled programs of each mode."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from testkit import data_parallel, tiny_lm_loss, tiny_lm_params
from testkit.hlo import collectives

DEVICES = 4
MICRO_BATCH = 2
SEQ_LEN = 10


def zeros_batch(*leading):
    zeros = np.zeros(leading + (MICRO_BATCH, SEQ_LEN), np.int32)
    return {"tokens": zeros, "labels": zeros}


@pytest.mark.parametrize("mode", ["shard_map", "jit"])
@pytest.mark.slow  # compiles a model or a multi-device program (> 1 s): make test, not test-fast
def test_one_all_reduce_per_window_in_the_boundary_loop(mode):
    run = data_parallel(lambda axis: jaxaccum.multi_steps(optax.adamw(1e-3), 4, axis_name=axis),
                        tiny_lm_loss, mode, DEVICES)  # fmt: skip
    params, state = run.init(tiny_lm_params())
    hlo = run.hlo(params, state, zeros_batch(DEVICES))
    # exactly one all-reduce (the gradient sums, the loss and the items travel
    # together), none on the micro-step path: it sits in the body of the boundary
    # loop, which runs once when the window closes and zero times otherwise
    assert [(c["op"], c["where"]) for c in collectives(hlo)] == [("all-reduce", "loop")]


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
    # the control: a collective inside the scan's body, run k times
    assert "loop" in [c["where"] for c in naive]
