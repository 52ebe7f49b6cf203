"""Between boundaries no collective runs: read off the compiled programs."""

from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._testing import all_reduce_placement, tiny_lm_loss, tiny_lm_params

DEVICES = 4
MICRO_BATCH = 2
SEQ_LEN = 10


def sharded_batch(mesh, leading=()):
    shape = leading + (DEVICES * MICRO_BATCH, SEQ_LEN)
    spec = P(*([None] * len(leading)), "data")
    sharding = jax.sharding.NamedSharding(mesh, spec)
    zeros = jnp.zeros(shape, jnp.int32)
    return jax.device_put({"tokens": zeros, "labels": zeros}, sharding), spec


def test_multi_steps_all_reduces_only_in_the_boundary_branch():
    mesh = jax.make_mesh((DEVICES,), ("data",))
    tx = jaxaccum.multi_steps(optax.adamw(1e-3), 4, axis_name="data")
    params = tiny_lm_params()
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, params), "data")
    state = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)
    batch, batch_spec = sharded_batch(mesh)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, batch_spec), out_specs=(P(), specs))
    def step(params, state, batch):
        local = jax.lax.pcast(params, "data", to="varying")
        (loss_sum, num_items), grads = jax.value_and_grad(tiny_lm_loss, has_aux=True)(local, batch)
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    placement = all_reduce_placement(step.lower(params, state, batch).compile().as_text())
    # exactly one all-reduce (gradient sums, loss sum and count travel together),
    # none on the micro-step path: it sits in the body of the boundary loop,
    # which runs once when the window closes and zero times otherwise
    assert placement["total"] == 1
    assert placement["entry"] == 0
    assert placement["loop_bodies"] == 1


def compiled_placement(loss_fn_of_params, params, batch, in_spec):
    mesh = jax.make_mesh((DEVICES,), ("data",))
    fn = jax.jit(
        jax.shard_map(loss_fn_of_params, mesh=mesh, in_specs=(P(), in_spec), out_specs=(P(), P()))
    )
    return all_reduce_placement(fn.lower(params, batch).compile().as_text())


def test_in_step_scan_has_as_many_all_reduces_as_one_big_batch_step():
    mesh = jax.make_mesh((DEVICES,), ("data",))
    params = tiny_lm_params()
    k = 8
    microbatches, micro_spec = sharded_batch(mesh, leading=(k,))
    big, big_spec = sharded_batch(mesh)

    def accumulated(params, microbatches):
        grads, metrics = jaxaccum.accumulate_gradients(
            tiny_lm_loss, params, microbatches, axis_name="data"
        )
        return grads, metrics["loss"]

    def big_batch(params, batch):
        # the same single step, k = 1
        grads, metrics = jaxaccum.accumulate_gradients(
            tiny_lm_loss, params, jax.tree.map(lambda x: x[None], batch), axis_name="data"
        )
        return grads, metrics["loss"]

    def naive_scan(params, microbatches):
        # differentiating w.r.t. replicated params: JAX psums every micro-batch
        def body(carry, mb):
            (loss_sum, num_items), grads = jax.value_and_grad(tiny_lm_loss, has_aux=True)(
                params, mb
            )
            return jax.tree.map(jnp.add, carry, grads), None

        grads, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), microbatches)
        return grads, jnp.zeros(())

    scan = compiled_placement(accumulated, params, microbatches, micro_spec)
    one = compiled_placement(big_batch, params, big, big_spec)
    naive = compiled_placement(naive_scan, params, microbatches, micro_spec)
    assert scan["total"] == one["total"] == 1
    assert scan["loop_bodies"] == 0  # nothing runs per micro-batch
    # the control: a collective inside the loop body, executed k times
    assert naive["loop_bodies"] >= 1
