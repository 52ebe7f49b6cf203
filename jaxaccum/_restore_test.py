"""`restore_state` into an optimizer configured otherwise than the saved one.

Two changes of configuration a run makes when it resumes: it leaves fp16 loss
scaling (the next updates must not stay divided by the old scale), and it
changes ``accumulator_dtype`` (refused on every device count: an open window's
sums are not recast). The routes themselves: ``_checkpoint_routes_test.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxaccum

# float32 sums of two micro-batches, scaled and unscaled by a power of two: a few ulps of O(1)
# gradients; the bug this guards against is a factor 65536
RTOL = 1e-6


def loss_fn(params, x, y):
    """A summed squared error and its item count."""
    return jnp.sum((x @ params["w"] - y) ** 2), jnp.float32(x.shape[0])


def window_update(micro_batches):
    """SGD(1) on the big batch: minus the gradient of (summed loss / items)."""
    x = np.concatenate([m[0] for m in micro_batches])
    y = np.concatenate([m[1] for m in micro_batches])
    grad = jax.grad(lambda p: loss_fn(p, x, y)[0] / x.shape[0])({"w": jnp.zeros(3)})
    return -np.asarray(grad["w"])


def test_a_state_saved_with_loss_scaling_resumes_unscaled_after_its_open_window():
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(n, 3)).astype(np.float32), rng.normal(size=n).astype(np.float32))
               for n in (2, 3, 1, 4)]  # fmt: skip
    params = {"w": jnp.zeros(3)}
    grad = jaxaccum.value_and_grad(loss_fn)
    scaled = jaxaccum.multi_steps(optax.sgd(1.0), 2, loss_scaling=jaxaccum.DynamicLossScale())
    state = scaled.init(params)
    (loss_sum, items), g = grad(params, *batches[0], loss_scale=jaxaccum.loss_scale(state))
    _, state = scaled.update(g, state, params, num_items=items, loss_sum=loss_sum)
    saved = jax.device_get(state)  # mid-window: the sums are scaled by 65536

    unscaled = jaxaccum.multi_steps(optax.sgd(1.0), 2)
    state = jaxaccum.restore_state(saved, like=unscaled.init(params))
    assert float(jaxaccum.loss_scale(state)) == 2.0**16  # the open window's sums keep theirs
    (loss_sum, items), g = grad(params, *batches[1], loss_scale=jaxaccum.loss_scale(state))
    updates, state = unscaled.update(g, state, params, num_items=items, loss_sum=loss_sum)
    np.testing.assert_allclose(updates["w"], window_update(batches[:2]), rtol=RTOL)
    assert float(jaxaccum.loss_scale(state)) == 1.0

    for batch in batches[2:]:  # the loop of a run without loss scaling: plain gradients
        (loss_sum, items), g = grad(params, *batch)
        updates, state = unscaled.update(g, state, params, num_items=items, loss_sum=loss_sum)
    np.testing.assert_allclose(updates["w"], window_update(batches[2:]), rtol=RTOL)
    assert jaxaccum.window_metrics(state).to_python()["loss_scale"] == 1.0


def mesh_state(tx, devices, window_step=1):
    """``tx.init`` on a mesh of ``devices`` (None: one device, no mesh), ``window_step``
    micro-batches in."""
    params = {"w": jnp.zeros(3)}
    if devices is None:
        state = tx.init(params)
        for _ in range(window_step):
            _, state = tx.update({"w": jnp.ones(3)}, state, params, num_items=1.0)
        return state
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    with jax.set_mesh(mesh):
        params = jax.device_put(params, P())
        state = tx.init(params)
        if window_step:
            grad = jaxaccum.value_and_grad(loss_fn, axis_name="data")
            x = jax.device_put(np.ones((devices, 3), np.float32), P("data"))
            y = jax.device_put(np.ones(devices, np.float32), P("data"))
            step = lambda s: tx.update(grad(params, x, y)[1], s, params, num_items=1.0)[1]
            state = jax.jit(step)(state)
        return state


@pytest.mark.parametrize("new_devices", [None, 2, 4])
def test_a_window_sum_in_another_accumulator_dtype_is_refused_on_any_device_count(new_devices):
    tx = lambda dtype, devices: jaxaccum.multi_steps(
        optax.sgd(1.0), 4, axis_name=devices and "data", accumulator_dtype=dtype
    )
    saved = jax.device_get(mesh_state(tx(jnp.float32, 4), 4))
    like = mesh_state(tx(jnp.bfloat16, new_devices), new_devices, window_step=0)
    with pytest.raises(ValueError, match=r"grad_sum\['w'\] was saved as float32.*has bfloat16"):
        jaxaccum.restore_state(saved, like=like)


def test_a_pmap_state_onto_another_device_count_is_refused_with_the_reason():
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 2, axis_name="data")
    state = lambda devices: jax.pmap(tx.init, devices=jax.devices()[:devices])(
        {"w": jnp.zeros((devices, 3))}
    )
    with pytest.raises(ValueError, match="window_step was saved as int32.4.*same number of dev"):
        jaxaccum.restore_state(jax.device_get(state(4)), like=state(2))


def test_a_pmap_state_onto_a_state_of_one_copy_is_refused_with_the_reason():
    # a copy of every leaf per device (one more leading axis) onto a jit state
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 2, axis_name="data")
    saved = jax.pmap(tx.init, axis_name="data", devices=jax.devices()[:4])({"w": jnp.zeros((4, 3))})
    like = jaxaccum.multi_steps(optax.sgd(1.0), 2).init({"w": jnp.zeros(3)})
    with pytest.raises(
        ValueError, match=r"window_step was saved as int32\[4\].*looks like a `pmap`"
    ):
        jaxaccum.restore_state(jax.device_get(saved), like=like)


def test_a_state_of_other_parameter_shapes_is_refused_naming_both_causes():
    # a 1-D leaf three long where two were saved: another model, or a pmap state's devices
    # (a leading axis apart: both read alike); a 2-D one with another last axis: no pmap hint
    tx = jaxaccum.multi_steps(optax.adam(1e-3), 2)
    saved = jax.device_get(tx.init({"w": jnp.zeros(2), "m": jnp.zeros((2, 2))}))
    like = tx.init({"w": jnp.zeros(3), "m": jnp.zeros((2, 2))})
    with pytest.raises(ValueError, match=r"mu\['w'\] was saved as float32\[2\].*another model"):
        jaxaccum.restore_state(saved, like=like)
    like = tx.init({"w": jnp.zeros(2), "m": jnp.zeros((2, 3))})
    with pytest.raises(ValueError, match=r"float32\[2, 2\].*same model and optimizer\?$"):
        jaxaccum.restore_state(saved, like=like)


@pytest.mark.parametrize("saved_as", ["key", "key_data"])
def test_a_train_state_with_a_prng_key_and_a_python_step_restores_onto_another_mesh(saved_as):
    # a whole train state: a module's dropout stream (a typed key) and TrainState.create's
    # step=0, a Python int (saved as numpy's int64), beside the optimizer state; 4 devices
    # saved, 2 restore. The key comes back bitwise whether saved as a key or as its uint32
    # data (an Orbax restore without a target); the window's items (exact small integers)
    # add up as saved
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 4, axis_name="data")
    key = jax.random.key(7)
    saved = {"step": np.int64(3), "key": key, "opt": jax.device_get(mesh_state(tx, 4))}
    if saved_as == "key_data":
        saved["key"] = np.asarray(jax.random.key_data(key))
    like = {"step": 0, "key": jax.random.key(0), "opt": mesh_state(tx, 2, window_step=0)}
    restored = jaxaccum.restore_state(saved, like=like)
    assert restored["step"] == 3 and type(restored["step"]) is int  # like `like`: no device
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(key))
    assert float(jnp.sum(restored["opt"].num_items)) == 1.0  # one micro-batch, num_items=1.0


def test_a_gspmd_state_restores_as_init_leaves_it_and_finishes_its_window():
    # under GSPMD (an Auto mesh, multi_steps without axis_name) init leaves its scalars
    # uncommitted, free to join the sharded params; a restore that committed them to one
    # device failed the next step ("incompatible devices"). Restored as init leaves them,
    # the window finishes as the uninterrupted run does (same devices: bitwise)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))  # fmt: skip
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 2)
    rng = np.random.default_rng(1)
    rows = [(rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=4).astype(np.float32))
            for _ in range(2)]  # fmt: skip
    put = lambda tree, spec: jax.device_put(tree, jax.NamedSharding(mesh, spec))

    @jax.jit
    def step(params, state, x, y):
        (loss_sum, items), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, y)
        updates, state = tx.update(grads, state, params, num_items=items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    params = put({"w": jnp.zeros(3)}, P())
    params, state = step(params, jax.jit(tx.init)(params), *put(rows[0], P("data")))
    like = jax.jit(tx.init)(params)
    assert not like.window_step.committed  # what this test is about
    restored = jaxaccum.restore_state(jax.device_get(state), like=like)
    assert not restored.window_step.committed
    resumed, _ = step(params, restored, *put(rows[1], P("data")))
    uninterrupted, _ = step(params, state, *put(rows[1], P("data")))
    np.testing.assert_array_equal(resumed["w"], uninterrupted["w"])
    np.testing.assert_allclose(resumed["w"], window_update(rows), rtol=RTOL)
