"""Unit tests of multi_steps: hand-computed windows, skips, schedules, dtypes, errors."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import losses
from testkit import standard


def quadratic_loss(params, batch):
    """Per-token loss (w - y)^2, summed; ``batch['n']`` tokens of target ``y``."""
    return batch["n"] * (params["w"] - batch["y"]) ** 2, batch["n"]


# Two micro-batches: 3 tokens with target 1, then 1 token with target 5, w = 0.
# Token-weighted (big batch):  grad = (3 * -2 + 1 * -10) / 4 = -4, loss = (3 + 25) / 4 = 7
# Mean of means:               grad = (-2 + -10) / 2 = -6,           loss = (1 + 25) / 2 = 13
HAND_BATCHES = [{"y": 1.0, "n": 3.0}, {"y": 5.0, "n": 1.0}]


def run_windows(tx, params, batches, loss_fn=quadratic_loss, **update_kwargs):
    state = tx.init(params)
    for batch in batches:
        (loss_sum, num_items), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, state = tx.update(
            grads, state, params, num_items=num_items, loss_sum=loss_sum, **update_kwargs
        )
        params = optax.apply_updates(params, updates)
    return params, state


def test_three_and_one_tokens_give_the_token_weighted_mean():
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 2)
    params, state = run_windows(tx, {"w": jnp.array(0.0)}, HAND_BATCHES)
    # exact in float32: small integers and a power-of-two divisor
    assert float(params["w"]) == 4.0
    metrics = jaxaccum.window_metrics(state)
    assert float(metrics.loss) == 7.0
    assert float(metrics.window_items) == 4.0
    assert float(metrics.grad_norm) == 4.0
    assert int(metrics.update_id) == 1
    assert bool(jaxaccum.has_updated(state))


def test_optax_multisteps_gives_the_mean_of_means_on_the_same_data():
    tx = standard(optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation())
    params = {"w": jnp.array(0.0)}
    state = tx.init(params)
    for batch in HAND_BATCHES:
        mean_loss = lambda p, batch=batch: quadratic_loss(p, batch)[0] / batch["n"]
        updates, state = tx.update(jax.grad(mean_loss)(params), state, params)
        params = optax.apply_updates(params, updates)
    # exact: (-2 + -10) / 2 = -6, the short micro-batch's token weighs 3x more
    assert float(params["w"]) == 6.0


HAND_BATCHES_STACKED = {"y": jnp.array([1.0, 5.0]), "n": jnp.array([3.0, 1.0])}


def test_accumulate_gradients_gives_the_same_window():
    batches = HAND_BATCHES_STACKED
    grads, metrics = jaxaccum.accumulate_gradients(quadratic_loss, {"w": jnp.array(0.0)}, batches)
    assert float(grads["w"]) == -4.0  # exact, see HAND_BATCHES
    assert float(metrics["loss"]) == 7.0
    assert float(metrics["window_items"]) == 4.0


def test_accumulate_gradients_on_an_nnx_module_split_as_its_error_says():
    from flax import nnx

    model = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
    model.kernel[...] = jnp.zeros((1, 1))
    loss_fn = lambda m, b: quadratic_loss({"w": m(jnp.ones((1, 1)))[0, 0]}, b)
    with pytest.raises(TypeError, match="nnx.split"):
        jaxaccum.accumulate_gradients(loss_fn, model, HAND_BATCHES_STACKED)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    merged = lambda p, b: loss_fn(nnx.merge(graphdef, p, rest), b)
    grads, metrics = jaxaccum.accumulate_gradients(merged, params, HAND_BATCHES_STACKED)
    assert float(grads["kernel"][...][0, 0]) == -4.0  # the window above, w = kernel
    assert float(metrics["window_items"]) == 4.0


def test_between_boundaries_updates_are_zero_and_state_accumulates():
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 2)
    params = {"w": jnp.array(0.0)}
    state = tx.init(params)
    (loss_sum, num_items), grads = jax.value_and_grad(quadratic_loss, has_aux=True)(
        params, HAND_BATCHES[0]
    )
    updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
    assert float(updates["w"]) == 0.0
    assert not bool(jaxaccum.has_updated(state))
    assert float(state.grad_sum["w"]) == -6.0  # 3 tokens x d/dw (w-1)^2 = 3 x -2
    assert float(state.num_items) == 3.0 and float(state.loss_sum) == 3.0
    assert int(state.window_step) == 1 and int(state.last_window.update_id) == 0


def test_end_window_closes_a_partial_tail_by_its_real_count():
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 4)
    params, state = run_windows(tx, {"w": jnp.array(0.0)}, HAND_BATCHES[:1], end_window=True)
    # one micro-batch of 3 tokens, target 1: grad -2, divided by its 3 tokens, not by k
    assert float(params["w"]) == 2.0
    assert int(jaxaccum.window_metrics(state).micro_step) == 1
    assert int(state.window_step) == 0


def test_max_grad_norm_clips_the_window_once_like_torch():
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 2, max_grad_norm=1.0)
    params, state = run_windows(tx, {"w": jnp.array(0.0)}, HAND_BATCHES)
    # window grad -4 -> coef 1 / (4 + 1e-6); clipping each micro-batch would give
    # -(1 + 1) / 2 instead. fp32 rounding of the coefficient: 1e-6.
    np.testing.assert_allclose(float(params["w"]), 4.0 / (4.0 + 1e-6), rtol=1e-6)
    metrics = jaxaccum.window_metrics(state)
    assert float(metrics.grad_norm) == 4.0
    np.testing.assert_allclose(float(metrics.grad_norm_clipped), 1.0, rtol=1e-6)


def test_variable_k_schedule():
    # window sizes 1, 2, 2, ...: the schedule sees the number of applied updates
    tx = jaxaccum.multi_steps(optax.sgd(1.0), lambda update_id: jnp.where(update_id < 1, 1, 2))
    params = {"w": jnp.array(0.0)}
    batches = [{"y": 0.0, "n": 1.0}] * 5
    _, state = run_windows(tx, params, batches)
    # micro-steps 1 | 2 3 | 4 5 -> 3 updates
    assert int(state.last_window.update_id) == 3
    assert int(state.window_step) == 0


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.slow  # compiles a model or a multi-device program (> 1 s): make test, not test-fast
def test_schedule_counts_updates_not_micro_steps(k):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1.0, 3, 10)
    tx = jaxaccum.multi_steps(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), k)
    params = {"w": jnp.array(0.0)}
    state = tx.init(params)
    step = jax.jit(lambda g, s: tx.update(g, s, params, num_items=1.0))
    learning_rates = []
    for _ in range(6 * k):
        _, state = step({"w": jnp.array(1.0)}, state)
        if bool(jaxaccum.has_updated(state)):
            learning_rates.append(float(state.inner_state.hyperparams["learning_rate"]))
    # inject_hyperparams stores the lr of update i evaluated at count i: the same
    # 6 values for any k, the schedule never sees micro-steps. rtol 1e-6: the
    # cosine is evaluated inside jit here and eagerly below (float32 ulps).
    expected = [float(schedule(i)) for i in range(6)]
    np.testing.assert_allclose(learning_rates, expected, rtol=1e-6)


def test_zero_token_window_is_skipped_and_the_next_window_is_normal():
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2)
    params = {"w": jnp.array(0.0)}
    empty = [{"y": 1.0, "n": 0.0}, {"y": 5.0, "n": 0.0}]
    params_after, state = run_windows(tx, params, empty)
    assert float(params_after["w"]) == 0.0
    metrics = jaxaccum.window_metrics(state)
    assert bool(metrics.skipped) and int(metrics.skip_reason) == 1
    assert int(metrics.update_id) == 0 and int(metrics.skip_count) == 1
    assert int(state.inner_state[0].count) == 0  # adam's count did not move
    # next window: a normal update, as if the empty one never happened
    state_next = state
    for batch in HAND_BATCHES:
        (loss_sum, num_items), grads = jax.value_and_grad(quadratic_loss, has_aux=True)(
            params_after, batch
        )
        updates, state_next = tx.update(
            grads, state_next, params_after, num_items=num_items, loss_sum=loss_sum
        )
    fresh_updates = run_windows(jaxaccum.multi_steps(optax.adam(0.1), 2), params, HAND_BATCHES)[0]
    assert float(optax.apply_updates(params_after, updates)["w"]) == float(fresh_updates["w"])


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_nonfinite_window_is_skipped_and_the_state_stays_clean(bad):
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2)
    params = {"w": jnp.array(0.0)}
    state = tx.init(params)
    grads_seq = [{"w": jnp.array(bad)}, {"w": jnp.array(1.0)}]
    for grads in grads_seq:
        updates, state = tx.update(grads, state, params, num_items=1.0, loss_sum=bad)
        assert float(updates["w"]) == 0.0
    metrics = jaxaccum.window_metrics(state)
    assert bool(metrics.skipped) and int(metrics.skip_reason) == 2
    assert int(metrics.update_id) == 0
    # the record says what the window was; nothing that feeds a later window kept it
    assert not np.isfinite(float(metrics.grad_norm))
    for leaf in jax.tree.leaves(state._replace(last_window=())):
        assert bool(jnp.all(jnp.isfinite(leaf))), "the state kept a non-finite value"
    # next window applies normally: adam's first step moves w by -lr * sign(g)
    for _ in range(2):
        updates, state = tx.update({"w": jnp.array(1.0)}, state, params, num_items=1.0)
    # rtol 1e-5: adam's float32 bias correction 1 - 0.999 loses ~6e-6 relative
    np.testing.assert_allclose(float(updates["w"]), -0.1, rtol=1e-5)
    assert int(jaxaccum.window_metrics(state).update_id) == 1


def test_a_nonfinite_loss_skips_the_window_when_another_call_omits_loss_sum():
    # the loss of the window is then unknown (NaN in the record), but the sum of the losses
    # that were passed is not finite: the window is skipped as the README says
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 2)
    params = {"w": jnp.array(0.0)}
    state = tx.init(params)
    _, state = tx.update({"w": jnp.array(1.0)}, state, params, num_items=1.0, loss_sum=jnp.nan)
    updates, state = tx.update({"w": jnp.array(1.0)}, state, params, num_items=1.0)
    metrics = jaxaccum.window_metrics(state)
    assert float(updates["w"]) == 0.0 and bool(metrics.skipped)
    assert int(metrics.skip_reason) == jaxaccum.SkipReason.NONFINITE
    assert int(metrics.update_id) == 0
    # finite losses with one call omitting loss_sum: applied, the loss unknown (NaN)
    _, state = tx.update({"w": jnp.array(1.0)}, state, params, num_items=1.0, loss_sum=3.0)
    updates, state = tx.update({"w": jnp.array(1.0)}, state, params, num_items=1.0)
    assert float(updates["w"]) == -1.0 and np.isnan(float(jaxaccum.window_metrics(state).loss))


def test_no_recompilation_and_bf16_params_keep_their_dtypes():
    params = {"w": jnp.ones((3,), jnp.bfloat16), "b": jnp.zeros((), jnp.bfloat16)}
    tx = jaxaccum.multi_steps(optax.adamw(1e-2), 3)
    state = tx.init(params)
    assert state.grad_sum["w"].dtype == jnp.float32

    @jax.jit
    def step(params, state, x):
        loss_fn = lambda p: (jnp.sum((p["w"] * x + p["b"]).astype(jnp.float32) ** 2), 3.0)
        (loss_sum, num_items), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    dtypes_before = jax.tree.map(lambda x: x.dtype, (params, state))
    for i in range(7):  # boundaries after micro-steps 3 and 6
        params, state = step(params, state, jnp.asarray(i, jnp.bfloat16))
    assert step._cache_size() == 1
    assert jax.tree.map(lambda x: x.dtype, (params, state)) == dtypes_before
    assert int(state.last_window.update_id) == 2


def test_state_leaves_do_not_share_buffers_and_can_be_donated():
    params = {"a": jnp.zeros((4,)), "b": jnp.zeros((4,))}
    tx = jaxaccum.multi_steps(optax.adam(1e-2), 2)
    state = tx.init(params)
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]
    assert len(set(pointers)) == len(pointers)

    @partial(jax.jit, donate_argnums=(1,))
    def step(params, state):
        grads = jax.tree.map(jnp.ones_like, params)
        return tx.update(grads, state, params, num_items=1.0)

    for _ in range(3):
        old = [x for x in jax.tree.leaves(state) if x.size > 1]
        updates, state = step(params, state)
        # donation really happened for every array buffer (XLA may keep a scalar
        # whose input value is not needed, e.g. the `applied` flag)
        assert all(x.is_deleted() for x in old)
    assert int(state.last_window.update_id) == 1


class TestBadInput:
    def test_every_k_must_be_a_positive_int_or_callable(self):
        with pytest.raises(ValueError, match="every_k_schedule"):
            jaxaccum.multi_steps(optax.sgd(1.0), 0)
        with pytest.raises(TypeError, match="every_k_schedule"):
            jaxaccum.multi_steps(optax.sgd(1.0), 2.5)
        with pytest.raises(TypeError, match="every_k_schedule"):
            jaxaccum.multi_steps(optax.sgd(1.0), True)
        with pytest.raises(ValueError, match="every_k_schedule"):
            jaxaccum.multi_steps(optax.sgd(1.0), lambda update_id: 0)

    def test_count_is_required_and_checked(self):
        tx = jaxaccum.multi_steps(optax.sgd(1.0), 2)
        params = {"w": jnp.zeros(2)}
        state = tx.init(params)
        grads = {"w": jnp.ones(2)}
        with pytest.raises(TypeError, match="`num_items` is required"):
            tx.update(grads, state, params)
        with pytest.raises(ValueError, match="`num_items` must be a finite real number >= 0"):
            tx.update(grads, state, params, num_items=-1)
        with pytest.raises(ValueError, match="`num_items` must be a scalar"):
            tx.update(grads, state, params, num_items=jnp.ones(2))

    def test_gradient_tree_must_match_the_state(self):
        tx = jaxaccum.multi_steps(optax.sgd(1.0), 2)
        params = {"w": jnp.zeros(2)}
        state = tx.init(params)
        with pytest.raises(ValueError, match="structure of the parameters"):
            tx.update({"v": jnp.ones(2)}, state, params, num_items=1)
        with pytest.raises(ValueError, match=r"leaf \['w'\] has shape \(3,\)"):
            tx.update({"w": jnp.ones(3)}, state, params, num_items=1)
        with pytest.raises(TypeError, match="floating dtype"):
            tx.update({"w": jnp.ones(2, jnp.int32)}, state, params, num_items=1)
        # nothing was lost: the state still accepts a correct call
        updates, state = tx.update({"w": jnp.ones(2)}, state, params, num_items=1)
        assert float(state.num_items) == 1.0

    @pytest.mark.slow  # compiles a model or a multi-device program (> 1 s): make test, not test-fast
    def test_gradients_already_summed_by_shard_map_autodiff_are_rejected(self):
        mesh = jax.make_mesh((2,), ("data",))
        tx = jaxaccum.multi_steps(optax.sgd(1.0), 2, axis_name="data")
        params = {"w": jnp.zeros(())}
        specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, params), "data")
        state = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)

        @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=specs)
        def step(params, state, y):
            # differentiating w.r.t. replicated params: JAX psums the gradient
            loss_fn = lambda p: (
                jnp.sum((p["w"] - y) ** 2),
                jnp.asarray(y.size, jnp.float32) + 0 * y[0],
            )
            (loss_sum, num_items), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            return tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)[1]

        y = jax.device_put(jnp.arange(2.0), jax.sharding.NamedSharding(mesh, P("data")))
        with pytest.raises(ValueError, match="already summed over"):
            jax.jit(step)(params, state, y)


@pytest.mark.slow  # compiles a model or a multi-device program (> 1 s): make test, not test-fast
def test_causal_lm_counts_after_the_shift_and_matches_a_direct_sum():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 5, 7)), jnp.float32)
    labels = jnp.array([[3, 1, -100, 2, -100], [-100, -100, -100, -100, 4]])
    loss_sum, num_items = losses.causal_lm(logits, labels)
    # labels[:, 1:] valid: [1, 2] in row 0 and [4] in row 1 -> 3 tokens
    assert float(num_items) == 3.0
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    expected = -(log_probs[0, 0, 1] + log_probs[0, 2, 2] + log_probs[1, 3, 4])
    np.testing.assert_allclose(float(loss_sum), float(expected), rtol=1e-6)  # fp32

    sample_sum, samples = losses.causal_lm_per_sample(logits, labels)
    assert float(samples) == 2.0
    expected_samples = -(log_probs[0, 0, 1] + log_probs[0, 2, 2]) / 2 - log_probs[1, 3, 4]
    np.testing.assert_allclose(float(sample_sum), float(expected_samples), rtol=1e-6)

    masked = losses.per_sample(jnp.array([1.0, 2.0, 4.0]), jnp.array([True, False, True]))
    assert (float(masked[0]), float(masked[1])) == (5.0, 2.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_causal_lm_of_low_precision_logits_under_strict_promotion(dtype):
    # the session's promotion is strict (conftest.py): bf16 logits failed there (the compute
    # dtype came from jnp.promote_types); they are summed in float32, like float32 logits
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    labels = jnp.array([[3, 1, -100, 2, -100], [-100, -100, -100, -100, 4]])
    low_sum, low_items = losses.causal_lm(jnp.asarray(logits, dtype), labels)
    rounded = jnp.asarray(jnp.asarray(logits, dtype), jnp.float32)  # the same inputs in fp32
    loss_sum, num_items = losses.causal_lm(rounded, labels)
    assert low_sum.dtype == jnp.float32 and float(low_items) == float(num_items) == 3.0
    np.testing.assert_allclose(float(low_sum), float(loss_sum), rtol=1e-6)  # fp32 arithmetic


def test_a_zero_size_parameter_under_shard_map_is_carried_through_the_window():
    # an empty leaf (a bucket of zero rows) lost its shard_map vma in the boundary's reset
    mesh = jax.make_mesh((4,), ("data",))
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 2, axis_name="data")
    params = {"w": jnp.ones(3), "e": jnp.zeros((0,))}
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, params), "data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def loss_fn(p, b):
        return jnp.sum((b["x"] @ p["w"] + jnp.sum(p["e"]) - b["y"]) ** 2), jnp.float32(len(b["y"]))

    grad_fn = jaxaccum.value_and_grad(loss_fn, axis_name="data")

    def step(params, state, batch):
        (loss_sum, num_items), grads = grad_fn(params, batch)
        return tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)

    in_specs = (P(), specs, P("data"))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=(P(), specs)))
    rng = np.random.default_rng(0)
    rows = lambda *shape: rng.normal(size=shape).astype(np.float32)
    batches = [{"x": rows(8, 3), "y": rows(8)} for _ in range(2)]
    for batch in batches:
        placed = jax.device_put(batch, jax.NamedSharding(mesh, P("data")))
        updates, state = step(params, state, placed)
    big = {k: np.concatenate([b[k] for b in batches]) for k in ("x", "y")}
    grads = jax.grad(lambda p: loss_fn(p, big)[0] / 16.0)(params)
    assert updates["e"].shape == (0,)
    # float32 sums of 16 rows in another grouping: a few ulps of O(1) gradients
    np.testing.assert_allclose(updates["w"], -grads["w"], rtol=1e-5)
