"""A batch that is not split over ``axis_name`` is refused, on every route that has one.

With ``axis_name`` the loss runs per device on the device's rows; a numpy batch
or ``device_put(batch, P())`` would hand every device the whole batch, and the
window's items would read R times the truth (3032 for 379 on 8 devices, in the
run that found it). ``jaxaccum.value_and_grad`` refuses it under plain
``jit``, ``shard_map`` and Flax NNX, naming the argument and the fix.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxaccum
from testkit import nnx_micro_step

DEVICES = 4
K = 2
FIX = "jax.device_put(batch, P('data'))"


def loss_fn(params, batch):
    return jnp.sum(batch["m"] * (batch["x"] @ params["w"])[:, 0] ** 2), jnp.sum(batch["m"])


def make_params() -> dict:
    return {"w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)}


def make_batch() -> dict:
    rng = np.random.default_rng(0)
    mask = (rng.random(8) < 0.7).astype(np.float32)
    return {"x": rng.normal(size=(8, 3)).astype(np.float32), "m": mask}


def jit_step(tx, loss=loss_fn):
    @jax.jit
    def step(params, state, batch):
        (loss_sum, num_items), grads = jaxaccum.value_and_grad(loss, axis_name="data")(
            params, batch
        )
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    return step


@pytest.mark.parametrize("place", ["numpy", "replicated"])
def test_plain_jit_refuses_a_batch_not_split(place):
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    tx = jaxaccum.multi_steps(optax.sgd(0.1), K, axis_name="data")
    with jax.set_mesh(mesh):
        params = jax.device_put(make_params(), P())
        state = tx.init(params)
        batch = make_batch() if place == "numpy" else jax.device_put(make_batch(), P())
        with pytest.raises(ValueError, match="not split over the batch axis 'data'") as error:
            jit_step(tx)(params, state, batch)
        assert FIX in str(error.value) and "counted 4 times" in str(error.value)
        assert "args[0]['x']" in str(error.value)  # the argument, by its path


def test_on_several_processes_the_fix_builds_the_batch_from_each_process_s_rows(monkeypatch):
    # jax.device_put(batch, P("data")) of a batch each process built from its own rows keeps
    # one process's rows (the multi-host red team: half the rows dropped, no error)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    tx = jaxaccum.multi_steps(optax.sgd(0.1), K, axis_name="data")
    with jax.set_mesh(mesh):
        params = jax.device_put(make_params(), P())
        with pytest.raises(ValueError, match="not split over the batch axis 'data'") as error:
            jit_step(tx)(params, tx.init(params), jax.device_put(make_batch(), P()))
    assert "jax.make_array_from_process_local_data(" in str(error.value)
    assert FIX not in str(error.value)


def test_plain_jit_counts_a_split_batch_once():
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    tx = jaxaccum.multi_steps(optax.sgd(0.1), K, axis_name="data")
    with jax.set_mesh(mesh):
        params = jax.device_put(make_params(), P())
        state = tx.init(params)
        batch = jax.device_put(make_batch(), P("data"))
        for _ in range(K):
            params, state = jit_step(tx)(params, state, batch)
    # the window's items: the mask's ones of K micro-batches, exact in float32
    assert float(jaxaccum.window_metrics(state).window_items) == K * make_batch()["m"].sum()


def test_shard_map_refuses_a_batch_not_split():
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    tx = jaxaccum.multi_steps(optax.sgd(0.1), K, axis_name="data")
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, make_params()), "data")

    def per_device(params, state, batch):
        (loss_sum, num_items), grads = jaxaccum.value_and_grad(loss_fn, axis_name="data")(
            params, batch
        )
        return tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)

    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    state = jax.jit(init)(make_params())
    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), specs, P()),
                           out_specs=(P(), specs))  # fmt: skip
    with pytest.raises(ValueError, match="not split over the batch axis 'data'") as error:
        jax.jit(mapped)(make_params(), state, make_batch())
    assert "in_specs=P('data')" in str(error.value)


class Linear(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.asarray(make_params()["w"]))

    def __call__(self, x):
        return x @ self.w[...]


def nnx_loss(model, batch):
    return jnp.sum(batch["m"] * model(batch["x"])[:, 0] ** 2), jnp.sum(batch["m"])


def test_nnx_refuses_a_batch_not_split():
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    with jax.set_mesh(mesh):
        model = Linear()
        tx = jaxaccum.multi_steps(optax.sgd(0.1), K, axis_name="data")
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        micro_step = nnx_micro_step(nnx_loss, axis_name="data")

        with pytest.raises(ValueError, match="not split over the batch axis 'data'") as error:
            micro_step(model, optimizer, jax.device_put(make_batch(), P()))
        assert FIX in str(error.value)
        micro_step(model, optimizer, jax.device_put(make_batch(), P("data")))  # split: runs


def test_plain_jit_refuses_one_leaf_not_split():
    # x and the mask split, the per-row count left whole: each device would count all 8 rows
    # of it (32 items for 8), a silent wrong update
    def loss_with_counts(params, batch):
        return jnp.sum(batch["m"] * (batch["x"] @ params["w"])[:, 0] ** 2), jnp.sum(batch["n"])

    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    with jax.set_mesh(mesh):
        params = jax.device_put(make_params(), P())
        batch = jax.device_put(make_batch(), P("data"))
        batch["n"] = jax.device_put(np.ones(8, np.float32), P())
        grad_fn = jax.jit(jaxaccum.value_and_grad(loss_with_counts, axis_name="data"))
        with pytest.raises(ValueError, match="leaves of the batch are not split") as error:
            grad_fn(params, batch)
    assert "args[0]['n'] rows split over nothing" in str(error.value)
    assert "args[0]['x']" not in str(error.value) and FIX in str(error.value)


def test_accumulate_gradients_refuses_micro_batches_not_split():
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    microbatches = jax.tree.map(lambda x: np.stack([x, x]), make_batch())  # [k=2, rows, ...]
    with jax.set_mesh(mesh):
        params = jax.device_put(make_params(), P())
        step = jax.jit(lambda p, m: jaxaccum.accumulate_gradients(loss_fn, p, m, axis_name="data"))
        with pytest.raises(ValueError, match="accumulate_gradients: the batch is not split"):
            step(params, jax.device_put(microbatches, P()))
        _, metrics = step(params, jax.device_put(microbatches, P(None, "data")))
    assert float(metrics["window_items"]) == 2 * make_batch()["m"].sum()  # counted once


def sequence_loss(params, batch):  # rows of T tokens: x [rows, T, 3], mask [rows, T]
    return jnp.sum(batch["m"] * (batch["x"] @ params["w"])[..., 0] ** 2), jnp.sum(batch["m"])


def sequence_batch() -> dict:
    rng = np.random.default_rng(1)
    mask = (rng.random((8, DEVICES)) < 0.7).astype(np.float32)
    return {"x": rng.normal(size=(8, DEVICES, 3)).astype(np.float32), "m": mask}


def test_plain_jit_refuses_a_batch_split_over_its_sequence_axis():
    # split over T, not the rows: each device would hold every row's slice of T, its sums
    # and counts of a part of each row (window_items 84 for 110 in the run that found it)
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    tx = jaxaccum.multi_steps(optax.sgd(0.1), K, axis_name="data")
    with jax.set_mesh(mesh):
        params = jax.device_put(make_params(), P())
        state = tx.init(params)
        step = jit_step(tx, sequence_loss)
        with pytest.raises(ValueError, match="the batch is not split over the batch axis") as error:
            step(params, state, jax.device_put(sequence_batch(), P(None, "data")))
        assert "args[0]['x'] rows split over nothing (sharding " in str(error.value)
        assert "a slice of every row instead of rows of its own" in str(error.value)
        assert "The rows are the leading axis" in str(error.value)
        for _ in range(K):  # the rows split: runs, and counts each item once
            params, state = step(params, state, jax.device_put(sequence_batch(), P("data")))
    # the mask's ones of K micro-batches, exact in float32
    assert float(jaxaccum.window_metrics(state).window_items) == K * sequence_batch()["m"].sum()


def test_accumulate_gradients_refuses_micro_batches_split_over_their_sequence_axis():
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    microbatches = jax.tree.map(lambda x: np.stack([x, x]), sequence_batch())  # [k=2, rows, T..]
    with jax.set_mesh(mesh):
        params = jax.device_put(make_params(), P())
        step = jax.jit(
            lambda p, m: jaxaccum.accumulate_gradients(sequence_loss, p, m, axis_name="data")
        )
        with pytest.raises(ValueError, match="accumulate_gradients: the batch is not split"):
            step(params, jax.device_put(microbatches, P(None, None, "data")))


def test_plain_jit_refuses_one_leaf_split_over_its_sequence_axis():
    # x split over its rows, the mask over its tokens: the mask's leaf is named, sliced
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    with jax.set_mesh(mesh):
        params = jax.device_put(make_params(), P())
        batch = jax.device_put(sequence_batch(), {"x": P("data"), "m": P(None, "data")})
        grad_fn = jax.jit(jaxaccum.value_and_grad(sequence_loss, axis_name="data"))
        with pytest.raises(ValueError, match="leaves of the batch are not split") as error:
            grad_fn(params, batch)
    assert "args[0]['m'] rows split over nothing" in str(error.value)
    assert "args[0]['x']" not in str(error.value)
    assert "a slice of every row instead of rows of its own" in str(error.value)


def test_accumulate_gradients_takes_micro_batches_split_over_their_own_axis():
    # each device scans its own micro-batches, all their rows: the same sums as the rows split
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    microbatches = jax.tree.map(lambda *xs: np.stack(xs), *[sequence_batch()] * DEVICES)
    with jax.set_mesh(mesh):
        params = jax.device_put(make_params(), P())
        step = jax.jit(
            lambda p, m: jaxaccum.accumulate_gradients(sequence_loss, p, m, axis_name="data")
        )
        by_rows = step(params, jax.device_put(microbatches, P(None, "data")))
        by_micro_batch = step(params, jax.device_put(microbatches, P("data")))
    assert float(by_micro_batch[1]["window_items"]) == DEVICES * sequence_batch()["m"].sum()
    # the same sums in another order: float32 rounding of a few additions
    for a, b in zip(jax.tree.leaves(by_rows), jax.tree.leaves(by_micro_batch), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
