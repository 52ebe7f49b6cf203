"""`restore_state` and the window sums' rows: folded onto a new device count, checked.

A window sum under ``axis_name`` holds one row per device. Onto fewer devices the
saved rows fold (row ``i`` of ``N`` onto row ``i * M // N``: consecutive rows, as
an ``M``-device run splits the batch), so that no row holds more than a run on
the new count would (a float16 row that held the whole window's sum
overflowed); onto as many or more devices they are copied as they are. A leading
axis is read as device rows only where both states have rows, and the shape per
row must be the target's: another model's state is refused, never summed up.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum
from testkit.modes import data_parallel

F, G = 3, 8  # features, global rows per micro-batch


def loss_fn(params, batch):
    """A summed squared error of a linear model and its item count."""
    x, y = batch["x"], batch["y"]
    return jnp.sum((x @ params["w"] + params["b"] - y) ** 2), jnp.asarray(x.shape[0], jnp.float32)


def params0():
    return {"w": jnp.asarray([0.1, -0.2, 0.3], jnp.float32), "b": jnp.zeros((), jnp.float32)}


def constant_batch(y):
    """``x = 0``: the gradient of ``b`` on each row is ``-2 y``; ``w``'s is 0."""
    return {"x": np.zeros((G, F), np.float32), "y": np.full(G, y, np.float32)}


def make(devices, mode="jit", **kw):
    """A ``multi_steps(sgd(1), 4)`` loop on ``devices`` devices (``kw``: its options)."""
    tx_fn = lambda axis: jaxaccum.multi_steps(optax.sgd(1.0), 4, axis_name=axis, **kw)
    return data_parallel(tx_fn, loss_fn, mode, devices)


def run(dp, devices, params, state, batches):
    for batch in batches:
        per_device = {k: v.reshape(devices, -1, *v.shape[1:]) for k, v in batch.items()}
        params, state = dp.step(params, state, per_device)
    return params, state


# 8 devices: 1 row each, gradient 10,000 per micro-batch; 4 devices: 2 rows, 20,000. After 2
# micro-batches a 4-device row holds 40,000 (float16's largest is 65,504); the whole
# window's 160,000 fits in no float16 row
F16_WINDOW = [constant_batch(-5000.0)] * 2 + [constant_batch(4900.0)] * 2


def saved_mid_window(devices, batches, **kw):
    dp = make(devices, **kw)
    params, state = run(dp, devices, *dp.init(params0()), batches)
    return jax.device_get(state)


@pytest.mark.parametrize("saved_as", ["state", "dicts"])
def test_float16_sums_fold_onto_fewer_devices_and_the_window_applies_as_there(saved_as):
    # every float16 sum here is a multiple of 16 below 2**16 (exact in float16), so the
    # folded rows equal the 4-device run's rows bitwise and so does the update: b = -100.
    # "dicts": the state as Orbax's restore without a target gives it (rows found by name)
    f16 = dict(accumulator_dtype=jnp.float16)
    saved = saved_mid_window(8, F16_WINDOW[:2], **f16)
    if saved_as == "dicts":
        saved = {**saved._asdict(), "last_window": saved.last_window._asdict()}
    dp = make(4, **f16)
    params, like = dp.init(params0())
    restored = jaxaccum.restore_state(saved, like)
    np.testing.assert_array_equal(np.asarray(restored.grad_sum["b"]), np.full(4, 40000.0))
    resumed, state = run(dp, 4, params, restored, F16_WINDOW[2:])
    uninterrupted, _ = run(dp, 4, *dp.init(params0()), F16_WINDOW)
    assert not bool(jaxaccum.window_metrics(state).skipped)
    np.testing.assert_array_equal(dp.one(resumed)["b"], -100.0)
    for name in ("w", "b"):
        np.testing.assert_array_equal(dp.one(resumed)[name], dp.one(uninterrupted)[name])


def test_uneven_float16_rows_fold_as_the_fewer_devices_hold_them():
    # a 4-device run's device j holds the rows of 8-device devices 2j and 2j + 1: rows
    # [32768, 64, 64, 64] twice fold to [32832, 128, 32832, 128], exact in float16 (its
    # spacing at 32768 is 32); rows i and i + 4 would add 32768 twice: 65536, inf
    saved = saved_mid_window(8, F16_WINDOW[:1], accumulator_dtype=jnp.float16)
    uneven = np.array([32768.0, 64, 64, 64] * 2, np.float16)
    saved = saved._replace(grad_sum={**saved.grad_sum, "b": uneven})
    _, like = make(4, accumulator_dtype=jnp.float16).init(params0())
    restored = jaxaccum.restore_state(saved, like)
    np.testing.assert_array_equal(np.asarray(restored.grad_sum["b"]), [32832, 128, 32832, 128])


def test_float16_sums_that_no_new_row_can_hold_are_refused_never_restored_as_inf():
    # 8 -> 2: each new row would hold 4 saved rows, 80,000 > 65,504
    saved = saved_mid_window(8, F16_WINDOW[:2], accumulator_dtype=jnp.float16)
    _, like = make(2, accumulator_dtype=jnp.float16).init(params0())
    with pytest.raises(ValueError, match=r"grad_sum\['b'\] is finite as saved.*overflows float16"):
        jaxaccum.restore_state(saved, like)


def test_rows_fold_in_float64_onto_fewer_devices_and_are_copied_onto_more():
    # float32 rows: new row j is float32(float64 sum of saved rows 2j, 2j + 1), rounded
    # once (compared bitwise with numpy's float64 sum in the same order); onto more
    # devices the saved rows come back bitwise, zeros after them
    rng = np.random.default_rng(5)
    batches = [{"x": rng.normal(size=(G, F)).astype(np.float32),
                "y": rng.normal(size=G).astype(np.float32)} for _ in range(2)]  # fmt: skip
    saved = saved_mid_window(8, batches)
    rows = np.asarray(saved.grad_sum["w"])
    _, like = make(4).init(params0())
    folded = np.asarray(jaxaccum.restore_state(saved, like).grad_sum["w"])
    want = (rows[0::2].astype(np.float64) + rows[1::2].astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(folded, want)

    saved = saved_mid_window(2, batches)
    _, like = make(4).init(params0())
    restored = jaxaccum.restore_state(saved, like)
    copied = np.asarray(restored.grad_sum["w"])
    np.testing.assert_array_equal(copied[:2], np.asarray(saved.grad_sum["w"]))
    np.testing.assert_array_equal(copied[2:], 0.0)
    np.testing.assert_array_equal(np.asarray(restored.num_items), [8.0, 8.0, 0.0, 0.0])


def test_another_models_window_sum_is_refused_without_device_rows():
    # one device, a stateless inner (no inner leaf to catch it): a 5x3 embedding's sum was
    # read as 5 device rows and summed into row 0 of a 7x3 one
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 4)
    old = {"emb": jnp.zeros((5, 3))}
    _, state = tx.update({"emb": jnp.ones((5, 3))}, tx.init(old), old, num_items=1.0)
    like = tx.init({"emb": jnp.zeros((7, 3))})
    with pytest.raises(
        ValueError, match=r"grad_sum\['emb'\] was saved as float32\[5, 3\].*float32\[7, 3\]"
    ):
        jaxaccum.restore_state(jax.device_get(state), like=like)


def test_another_models_window_sum_is_refused_from_device_rows_onto_one_device():
    # 4 devices' rows of a 3-vector's sum ([4, 3]) onto one device's [2, 3] parameter: the
    # leading axis is the saved rows, and [3] is not [2, 3]
    saved = saved_mid_window(4, [constant_batch(1.0)])
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 4)
    like = tx.init({"w": jnp.zeros((2, 3)), "b": jnp.zeros(())})
    with pytest.raises(ValueError, match=r"grad_sum\['w'\] was saved as float32\[4, 3\]"):
        jaxaccum.restore_state(saved, like=like)


def test_a_jit_state_onto_a_pmap_state_is_refused_naming_like_as_pmap():
    saved = saved_mid_window(4, [constant_batch(1.0)])
    dp = make(4, mode="pmap")
    _, like = dp.init(params0())
    with pytest.raises(
        ValueError, match=r"window_step was saved as int32\[\].*or `like` is a `pmap` state"
    ):
        jaxaccum.restore_state(saved, like=like)


@pytest.mark.parametrize(
    ("field", "words"),
    [("grad_sum", "`accumulator_dtype`"), ("grad_sum", "`jax_enable_x64`"),
     ("num_items", "`jax_enable_x64`"), ("loss_sum", "`jax_enable_x64`")],
)  # fmt: skip
def test_a_window_sum_in_float64_onto_float32_names_the_setting(field, words):
    # a float64 save (accumulator_dtype=jnp.float64 under jax_enable_x64) read back in a
    # float32 run: the message names the setting that differs
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 4)
    params = {"w": jnp.zeros(3)}
    _, state = tx.update({"w": jnp.ones(3)}, tx.init(params), params, num_items=1.0, loss_sum=2.0)
    saved = jax.device_get(state)
    wide = jax.tree.map(lambda x: np.asarray(x, np.float64), getattr(saved, field))
    with pytest.raises(ValueError, match=rf"{field}.*saved as float64.*{words}"):
        jaxaccum.restore_state(saved._replace(**{field: wide}), like=tx.init(params))
