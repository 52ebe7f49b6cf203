"""``update``'s extra arguments reach the inner optimizer once per window, as the big batch's.

``value=jaxaccum.WINDOW_LOSS`` hands the inner the window's mean loss (its ``loss_sum`` over
its ``num_items``, over every device) on every route; a micro-batch's own ``value``, the
objective's ``grad`` or ``value_fn`` at the parameters, a function, an extra argument that
varies over the devices and an inner that accumulates itself are refused.
"""

from __future__ import annotations

import copy
import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import jaxaccum
from testkit.modes import data_parallel

K = 2  # micro-batches per window
WINDOWS = 2
DEVICES = 2
D = 3  # features
# valid rows per (window, micro-batch, device), out of ROWS: uneven, so a micro-batch's mean
# loss is not the window's
ROWS = 4
VALID = [[[4, 1], [2, 3]], [[1, 4], [3, 0]]]
POLYAK = dict(max_learning_rate=1.0, scaling=0.5)


def loss_fn(params, batch):
    """Squared error summed over the valid rows, and their count."""
    err = batch["x"] @ params["w"] + params["b"] - batch["y"]
    return jnp.sum(batch["valid"] * err**2), jnp.sum(batch["valid"])


def batches(devices: int) -> list[dict]:
    """Per micro-step: ``[devices, ROWS, ...]`` leaves (``devices`` 1: the two devices' rows
    side by side on one)."""
    rng = np.random.default_rng(0)
    out = []
    for window in VALID:
        for per_device in window:
            valid = np.array([np.arange(ROWS) < n for n in per_device], np.float32)
            x = rng.normal(size=(DEVICES, ROWS, D)).astype(np.float32)
            y = rng.normal(size=(DEVICES, ROWS)).astype(np.float32)
            batch = dict(x=x, y=y, valid=valid)
            shape = (devices, -1)
            out.append({k: v.reshape(shape + v.shape[2:]) for k, v in batch.items()})
    return out


def with_window_loss(tx: optax.GradientTransformationExtraArgs):
    """``tx`` whose ``update`` always passes ``value=jaxaccum.WINDOW_LOSS`` (a constant: it
    travels through jit, shard_map and pmap as the program's, not as an operand)."""
    return optax.GradientTransformationExtraArgs(
        tx.init, functools.partial(tx.update, value=jaxaccum.WINDOW_LOSS)
    )


def big_batch_updates(params: dict, inner: optax.GradientTransformation) -> list[np.ndarray]:
    """``inner`` once per window on the mean gradient of all its rows, ``value`` their mean
    loss (float64)."""
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    state, updates, micro = inner.init(params), [], batches(1)
    for w in range(WINDOWS):
        window = [micro[w * K + m] for m in range(K)]
        rows = {
            k: np.concatenate([mb[k][0] for mb in window]).astype(np.float64) for k in window[0]
        }
        with jax.enable_x64(), jax.numpy_dtype_promotion("standard"):  # optax's own code
            (loss_sum, n), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rows)
            mean = jax.tree.map(lambda g, n=n: g / n, grads)
            update, state = inner.update(mean, state, params, value=loss_sum / n)
            params = jax.tree.map(np.asarray, optax.apply_updates(params, update))
        updates.append(np.asarray(update["w"]))
    return updates


PARAMS = {"w": jnp.array([0.5, -1.0, 0.25], jnp.float32), "b": jnp.array(0.1, jnp.float32)}


@pytest.mark.parametrize("mode", ["one_device", "jit", "gspmd", "shard_map", "pmap"])
def test_window_loss_is_the_big_batch_value_on_every_route(mode):
    # polyak_sgd's step is (value - f_min) / |g|^2: a micro-batch's loss moves it (the last
    # micro-batch's: 0.54 where the window's is 0.48 in the red team's case). float32 sums of
    # 16 rows against float64: 1e-5 relative
    devices = 1 if mode == "one_device" else DEVICES
    tx_fn = lambda axis: with_window_loss(
        jaxaccum.multi_steps(optax.polyak_sgd(**POLYAK), K, axis_name=axis)
    )
    run = data_parallel(tx_fn, loss_fn, mode, devices)
    params, state = run.init(PARAMS)
    got = []
    for step, batch in enumerate(batches(devices)):
        before = run.one(params)["w"]
        params, state = run.step(params, state, batch)
        if step % K == K - 1:
            got.append(run.one(params)["w"] - before)
    want = big_batch_updates(PARAMS, optax.polyak_sgd(**POLYAK))
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-5, atol=1e-7)


def test_reduce_on_plateau_sees_the_window_losses():
    # its state counts windows and their mean losses: the big batch's schedule, window by
    # window (float32 against float64: 1e-6 relative)
    plateau = optax.contrib.reduce_on_plateau(factor=0.5, patience=0, cooldown=0)
    inner = optax.chain(optax.sgd(0.1), plateau)
    tx = jaxaccum.multi_steps(inner, K)
    params, state, got = PARAMS, tx.init(PARAMS), []
    for step, batch in enumerate(batches(1)):
        one = jax.tree.map(lambda x: x[0], batch)
        (loss_sum, n), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, one)
        updates, state = tx.update(
            grads, state, params, num_items=n, loss_sum=loss_sum, value=jaxaccum.WINDOW_LOSS
        )
        params = optax.apply_updates(params, updates)
        if step % K == K - 1:
            got.append(np.asarray(updates["w"]))
    want = big_batch_updates(PARAMS, inner)
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-6)


def update(extra: dict, inner=None, **kw):
    """One ``update`` of a one-device ``multi_steps`` with ``extra`` arguments."""
    tx = jaxaccum.multi_steps(inner or optax.sgd(0.1), K)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    kw = dict(num_items=2.0, loss_sum=1.0) | kw
    return tx.update(grads, tx.init(PARAMS), PARAMS, **kw, **extra)


@pytest.mark.parametrize(
    "extra, kw, match",
    [
        (dict(value=jnp.array(0.5)), {}, r"`value`.*pass value=jaxaccum.WINDOW_LOSS"),
        (dict(value=0.5), {}, r"`value`.*window's mean loss"),
        (dict(value=jaxaccum.WINDOW_LOSS), dict(loss_sum=None), "needs loss_sum= on every"),
        (dict(grad=PARAMS), {}, r"`grad` is for an inner optimizer with a line search"),
        (dict(value_fn=lambda p: 0.0), {}, r"`value_fn` is for .*line search"),
        (dict(grad_fn=lambda p, b: p), {}, r"`grad_fn` holds a function.*one micro-batch"),
        (dict(obj_fn={"f": jnp.sum}), {}, r"`obj_fn` holds a function"),
    ],
)
def test_an_extra_argument_of_one_micro_batch_is_refused(extra, kw, match):
    with pytest.raises(TypeError, match=match):
        update(extra, **kw)


def test_constant_and_array_extra_arguments_reach_the_inner_as_given():
    # an inner that reads an extra argument of its own: the closing call's, as given
    def inner_update(updates, state, params=None, *, scale, **extra):
        return jax.tree.map(lambda u: -scale * u, updates), state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), inner_update)
    for scale in (2.0, jnp.array(2.0)):
        tx = jaxaccum.multi_steps(inner, 1)
        grads = jax.tree.map(jnp.ones_like, PARAMS)
        updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS, num_items=2.0, scale=scale)
        assert float(updates["b"]) == -1.0  # -2 x (2 / 2 items): exact in float32


@pytest.mark.parametrize(
    "inner",
    [
        optax.MultiSteps(optax.sgd(0.1), 2).gradient_transformation(),
        jaxaccum.multi_steps(optax.sgd(0.1), 2),
        optax.chain(optax.clip(1.0), optax.MultiSteps(optax.sgd(0.1), 2).gradient_transformation()),
        optax.chain(optax.apply_every(2), optax.sgd(0.1)),
    ],
    ids=["optax.MultiSteps", "jaxaccum.multi_steps", "in_a_chain", "optax.apply_every"],
)
def test_an_inner_that_accumulates_itself_is_refused_at_init(inner):
    # its window would average jaxaccum's window means: the mean-of-means bug
    with pytest.raises(TypeError, match=r"`inner` accumulates micro-batches itself"):
        jaxaccum.multi_steps(inner, 2).init(PARAMS)


def test_an_extra_argument_that_varies_over_the_devices_is_refused_under_shard_map():
    # every device runs the inner update on the same window gradient: a per-device `scale`
    # would move each device's parameters apart
    inner = optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), lambda u, s, p=None, *, scale, **e: (u, s)
    )
    tx = jaxaccum.multi_steps(inner, 2, axis_name="data")
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, PARAMS), "data")
    P = jax.sharding.PartitionSpec

    def per_device(params, state, scale):
        grads = jax.lax.pcast(jax.tree.map(jnp.ones_like, params), "data", to="varying")
        return tx.update(grads, state, params, num_items=1.0, scale=scale[0])

    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    step = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), specs, P("data")),
                         out_specs=(P(), specs))  # fmt: skip
    scales = jax.device_put(jnp.arange(DEVICES, dtype=jnp.float32), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"`scale` varies over \['data'\]"):
        jax.jit(step)(PARAMS, jax.jit(init)(PARAMS), scales)


def test_window_loss_is_one_object_through_copies_and_pickles():
    # a config deep-copied or sent to another process keeps its meaning
    assert copy.deepcopy({"value": jaxaccum.WINDOW_LOSS})["value"] is jaxaccum.WINDOW_LOSS
    assert pickle.loads(pickle.dumps(jaxaccum.WINDOW_LOSS)) is jaxaccum.WINDOW_LOSS


def test_window_loss_read_by_an_optimizer_chained_after_multi_steps_says_where_it_belongs():
    tx = optax.chain(jaxaccum.multi_steps(optax.sgd(0.1), K), optax.contrib.reduce_on_plateau())
    with (  # reduce_on_plateau is optax's code: standard promotion
        jax.numpy_dtype_promotion("standard"),
        pytest.raises(TypeError, match="reached an optimizer outside multi_steps"),
    ):
        tx.update(
            jax.tree.map(jnp.ones_like, PARAMS), tx.init(PARAMS), PARAMS,
            num_items=1.0, loss_sum=1.0, value=jaxaccum.WINDOW_LOSS,
        )  # fmt: skip


def test_a_window_whose_loss_is_not_known_is_skipped_without_an_overflow():
    # a call without loss_sum, then value=WINDOW_LOSS: the inner would read a partial loss, so
    # the window is skipped (non-finite: its loss is NaN); nothing overflowed, so the loss
    # scale stays (2**16: powers of two, exact)
    def inner_update(updates, state, params=None, *, value=None, **extra):
        return updates, state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), inner_update)
    tx = jaxaccum.multi_steps(inner, K, loss_scaling=jaxaccum.DynamicLossScale())
    grads, state = jax.tree.map(jnp.ones_like, PARAMS), tx.init(PARAMS)
    _, state = tx.update(grads, state, PARAMS, num_items=1.0)
    _, state = tx.update(
        grads, state, PARAMS, num_items=1.0, loss_sum=1.0, value=jaxaccum.WINDOW_LOSS
    )
    record = jaxaccum.window_metrics(state)
    assert bool(record.skipped) and int(record.skip_reason) == jaxaccum.SkipReason.NONFINITE
    assert float(jaxaccum.loss_scale(state)) == 2.0**16


def test_window_loss_passes_through_jit_as_an_argument():
    # a generic step(params, state, batch, **extra) under jit: WINDOW_LOSS is a pytree of no
    # leaves, a constant of the program; polyak's step, one window: exact in float32 (1e-6)
    tx = jaxaccum.multi_steps(optax.polyak_sgd(**POLYAK), 1)

    def step(params, state, batch, **extra):
        (loss_sum, n), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, state = tx.update(grads, state, params, num_items=n, loss_sum=loss_sum, **extra)
        return optax.apply_updates(params, updates), state

    batch = jax.tree.map(lambda x: x[0], batches(1)[0])
    new, _ = jax.jit(step)(PARAMS, tx.init(PARAMS), batch, value=jaxaccum.WINDOW_LOSS)
    with jax.enable_x64(), jax.numpy_dtype_promotion("standard"):  # the reference, float64
        as64 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), tree)
        (loss_sum, n), grads = jax.value_and_grad(loss_fn, has_aux=True)(as64(PARAMS), as64(batch))
        inner = optax.polyak_sgd(**POLYAK)
        mean = jax.tree.map(lambda g: g / n, grads)
        want, _ = inner.update(mean, inner.init(as64(PARAMS)), as64(PARAMS), value=loss_sum / n)
        got = np.asarray(new["w"], np.float64) - np.asarray(PARAMS["w"], np.float64)
        np.testing.assert_allclose(got, np.asarray(want["w"]), rtol=1e-5, atol=1e-7)


def test_an_inner_that_needs_value_without_it_is_told_to_pass_window_loss():
    with pytest.raises(TypeError, match=r"needs `value`.*pass value=jaxaccum.WINDOW_LOSS"):
        update({}, inner=optax.polyak_sgd())
