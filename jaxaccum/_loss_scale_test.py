"""fp16 dynamic loss scaling per window, and the non-finite policy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum


def loss_fn(params, y, n):
    return n * jnp.sum((params["w"] - y) ** 2), n


def run(tx, targets, params=None):
    """One micro-step per (y, n); returns params, state and per-call (scale, applied)."""
    params = {"w": jnp.zeros(3)} if params is None else params
    state = tx.init(params)
    grad_fn = jaxaccum.value_and_grad(loss_fn)

    @jax.jit
    def step(params, state, y, n):
        (loss_sum, num_items), grads = grad_fn(params, y, n, loss_scale=jaxaccum.loss_scale(state))
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    trace = []
    for y, n in targets:
        scale_before = float(jaxaccum.loss_scale(state))
        params, state = step(params, state, jnp.float32(y), jnp.float32(n))
        trace.append((scale_before, bool(jaxaccum.has_updated(state))))
    return params, state, trace


TARGETS = [(1.0, 3.0), (5.0, 1.0), (2.0, 2.0), (-1.0, 7.0), (0.5, 1.0), (3.0, 4.0)]


def test_power_of_two_scale_is_invisible():
    plain = jaxaccum.multi_steps(optax.adam(0.1), 2)
    scaled = jaxaccum.multi_steps(
        optax.adam(0.1), 2, loss_scaling=jaxaccum.DynamicLossScale(init_scale=2.0**10)
    )
    # scaling by 2^10 is exact in float32, but XLA may divide by N * 2^10 as a
    # multiplication by its reciprocal: 1 ulp per window, 3 adam steps -> rtol 1e-6
    p_plain = run(plain, TARGETS)[0]
    p_scaled = run(scaled, TARGETS)[0]
    np.testing.assert_allclose(p_plain["w"], p_scaled["w"], rtol=1e-6)
    assert not np.allclose(p_plain["w"], 0.0)  # the steps moved the parameters


def test_scale_is_constant_in_a_window_and_grows_at_boundaries():
    scaling = jaxaccum.DynamicLossScale(init_scale=4.0, growth_interval=2)
    tx = jaxaccum.multi_steps(optax.sgd(0.1), 2, loss_scaling=scaling)
    _, state, trace = run(tx, TARGETS + TARGETS[:2])
    scales = [scale for scale, _ in trace]
    # windows of 2 calls; the scale doubles after every 2 applied windows
    assert scales == [4.0, 4.0, 4.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert float(jaxaccum.loss_scale(state)) == 16.0
    assert int(state.good_windows) == 0


def test_overflow_window_is_skipped_and_the_scale_backs_off():
    scaling = jaxaccum.DynamicLossScale(init_scale=2.0**16, growth_interval=100)
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2, loss_scaling=scaling)
    # fp16 overflow stand-in: an inf target makes this micro-batch's gradient inf
    targets = [(1.0, 3.0), (float("inf"), 1.0), (1.0, 3.0), (5.0, 1.0)]
    params, state, trace = run(tx, targets)
    assert [applied for _, applied in trace] == [False, False, False, True]
    assert [scale for scale, _ in trace] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
    metrics = jaxaccum.window_metrics(state)
    assert int(metrics.update_id) == 1 and int(metrics.skip_count) == 1
    # the applied window is the first adam step, as if the overflow never happened
    fresh, _, _ = run(jaxaccum.multi_steps(optax.adam(0.1), 2), targets[2:])
    np.testing.assert_array_equal(params["w"], fresh["w"])  # same ops, same bits
    for leaf in jax.tree.leaves(state):
        assert bool(jnp.all(jnp.isfinite(leaf)))


def test_empty_window_leaves_the_scale_alone():
    scaling = jaxaccum.DynamicLossScale(init_scale=8.0, growth_interval=1)
    tx = jaxaccum.multi_steps(optax.sgd(0.1), 1, loss_scaling=scaling)
    _, state, _ = run(tx, [(1.0, 0.0)])
    assert float(jaxaccum.loss_scale(state)) == 8.0
    assert int(jaxaccum.window_metrics(state).skip_reason) == 1


def test_fp16_gradients_with_scaling_match_fp32_within_fp16_rounding():
    """Tiny gradients underflow in fp16 without a scale and survive with one."""

    def fp16_loss(params, y, n):
        w = params["w"].astype(jnp.float16)
        return n * jnp.sum((w - y.astype(jnp.float16)) ** 2).astype(jnp.float32) * 1e-6, n

    params = {"w": jnp.full((3,), 1e-3, jnp.float32)}
    grads = {}
    for name, scale in (("unscaled", 1.0), ("scaled", 2.0**16)):
        (_, _), g = jaxaccum.value_and_grad(fp16_loss)(
            params, jnp.float32(0.0), jnp.float32(1.0), loss_scale=scale
        )
        grads[name] = np.asarray(g["w"], np.float64) / scale
    exact = 2 * 1e-3 * 1e-6  # d/dw of 1e-6 * w^2 at w = 1e-3
    assert np.all(grads["unscaled"] == 0.0)  # underflow: 2e-9 < fp16's smallest subnormal
    # scaled: fp16 has an 11-bit mantissa, so 1e-3 relative is its rounding
    np.testing.assert_allclose(grads["scaled"], exact, rtol=1e-3)


def test_a_float16_loss_with_an_empty_micro_batch_is_not_skipped_at_the_default_scale():
    # the backward factor scale / max(n, 1) of a micro-batch without items is 2**16, beyond
    # float16's 65504: it is capped there (as inf, 0 * inf made a NaN gradient and skipped
    # a window whose other micro-batch, 3 items at 2**16 / 3, is finite)
    def fp16_loss(params, y, mask):  # rows of y, those of mask summed: a float16 loss_sum
        err = (params["w"][None, :].astype(jnp.float16) - y.astype(jnp.float16)) ** 2
        return jnp.sum(mask.astype(jnp.float16)[:, None] * err), jnp.sum(mask)

    tx = jaxaccum.multi_steps(optax.sgd(0.1), 2, loss_scaling=jaxaccum.DynamicLossScale())
    grad_fn = jaxaccum.value_and_grad(fp16_loss)

    @jax.jit
    def step(params, state, y, mask):
        (loss_sum, num_items), grads = grad_fn(
            params, y, mask, loss_scale=jaxaccum.loss_scale(state)
        )
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    y = jnp.full((4, 3), 0.01)
    for mask in ([1.0, 1.0, 1.0, 0.0], [0.0] * 4):  # 3 items, then a micro-batch without any
        params, state = step(params, state, y, jnp.asarray(mask))
    metrics = jaxaccum.window_metrics(state)
    assert int(metrics.skip_reason) == 0 and float(jaxaccum.loss_scale(state)) == 2.0**16
    # the window's gradient is 2 (w - y) = -0.02 per element, so w = 0.1 * 0.02; float16
    # holds y = 0.01 to 2**-11 relative: 1e-3
    np.testing.assert_allclose(np.asarray(params["w"]), 0.002, rtol=1e-3)


def test_nonfinite_raise_stops_with_a_clear_error():
    tx = jaxaccum.multi_steps(optax.sgd(0.1), 1, nonfinite="raise")
    with pytest.raises(Exception, match="non-finite gradient or loss"):
        _, state, _ = run(tx, [(float("nan"), 1.0)])
        jax.block_until_ready(state)


def test_bad_loss_scaling_arguments():
    with pytest.raises(ValueError, match="backoff_factor"):
        jaxaccum.DynamicLossScale(backoff_factor=1.5)
    with pytest.raises(ValueError, match="growth_interval"):
        jaxaccum.DynamicLossScale(growth_interval=0)
    with pytest.raises(ValueError, match="init_scale"):
        jaxaccum.DynamicLossScale(init_scale=float("inf"))
    with pytest.raises(TypeError, match="loss_scaling"):
        jaxaccum.multi_steps(optax.sgd(0.1), 1, loss_scaling=1024.0)
    with pytest.raises(ValueError, match="nonfinite"):
        jaxaccum.multi_steps(optax.sgd(0.1), 1, nonfinite="ignore")


def test_a_non_finite_loss_with_finite_gradients_skips_without_a_backoff():
    # a float16 loss_sum that overflowed: no smaller loss scale cures it (GradScaler backs off
    # for a non-finite gradient only); the window is skipped and the scale kept (2**16, exact)
    tx = jaxaccum.multi_steps(optax.sgd(0.1), 1, loss_scaling=jaxaccum.DynamicLossScale())
    params = {"w": jnp.zeros(2)}
    grads, state = jax.tree.map(jnp.ones_like, params), tx.init(params)
    _, state = tx.update(grads, state, params, num_items=1.0, loss_sum=jnp.float16(jnp.inf))
    record = jaxaccum.window_metrics(state)
    assert bool(record.skipped) and int(record.skip_reason) == jaxaccum.SkipReason.NONFINITE
    assert float(jaxaccum.loss_scale(state)) == 2.0**16
    grads = jax.tree.map(lambda g: g * jnp.nan, grads)  # a non-finite gradient: backed off
    _, state = tx.update(grads, state, params, num_items=1.0, loss_sum=1.0)
    assert float(jaxaccum.loss_scale(state)) == 2.0**15
