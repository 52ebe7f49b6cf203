"""The bad-input matrix: every bad input we tried, and what the user gets.

One test per row of ``docs/bad-inputs.md`` (same ids, checked below). A row
either raises (exception type and the start of its message are asserted) or
is a value jaxaccum handles at run time (a skipped window: skip reason asserted
and the state checked to be unchanged where it must be, reset where it must
be, and free of NaN/inf). 21 rows were bugs or unclear errors when the matrix
was first built (``fixed`` in the doc's status column); they now assert the
fixed behaviour. A row still marked ``xfail(strict=True)`` is a known
remaining problem: the test asserts the behaviour we expect, and the reason
says what happens instead.
"""

import pathlib
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

PARAMS = {"w": jnp.zeros(2)}
GRADS = {"w": jnp.ones(2)}
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bad-inputs.md"


def sgd(k=2, **kwargs):
    return jaxaccum.multi_steps(optax.sgd(1.0), k, **kwargs)


def update(tx=None, grads=GRADS, state=None, params=PARAMS, **kwargs):
    """One eager ``update`` call on a fresh state."""
    tx = sgd() if tx is None else tx
    state = tx.init(params) if state is None else state
    return tx.update(grads, state, params, **kwargs)


def run_jitted(tx, grads_seq, counts, loss_sums=None, params=PARAMS):
    """Jitted micro-steps with traced counts/losses; returns (updates list, state)."""
    state = tx.init(params)
    step = jax.jit(lambda g, s, c, l: tx.update(g, s, params, count=c, loss_sum=l))
    loss_sums = [1.0] * len(counts) if loss_sums is None else loss_sums
    all_updates = []
    for grads, count, loss in zip(grads_seq, counts, loss_sums, strict=True):
        updates, state = step(grads, state, jnp.float32(count), jnp.float32(loss))
        all_updates.append(updates)
    return all_updates, state


def assert_finite(state):
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        assert bool(jnp.all(jnp.isfinite(leaf))), (
            f"state leaf {jax.tree_util.keystr(path)} = {leaf} is not finite"
        )


def assert_skipped_clean(updates, state, reason, inner_before):
    """A skipped window: zero update, no counter moved, sums reset, no NaN kept."""
    # exact: a skipped window's updates are selected zeros, not computed ones
    np.testing.assert_array_equal(updates["w"], 0.0)
    metrics = jaxaccum.window_metrics(state)
    assert bool(metrics["skipped"]) and int(metrics["skip_reason"]) == reason
    assert int(metrics["update_id"]) == 0 and int(metrics["skip_count"]) == 1
    assert float(metrics["cumulative_count"]) == 0.0
    assert not bool(jaxaccum.has_updated(state))
    # the inner optimizer did not advance (bitwise: it was not touched)
    jax.tree.map(np.testing.assert_array_equal, state.inner_state, inner_before)
    # the window sums were reset with fresh zeros (exact)
    np.testing.assert_array_equal(state.grad_sum["w"], 0.0)
    assert float(jnp.sum(state.count)) == 0.0 and float(jnp.sum(state.loss_sum)) == 0.0
    assert_finite(state)


# --------------------------------------------------------------------------
# Rows that raise: (id, thunk, exception type, regex searched in the message).
# Our own messages are anchored at their start (^).
# --------------------------------------------------------------------------

K_MSG = r"^multi_steps: `every_k_schedule` must be"
SCHED_MSG = r"^multi_steps: `every_k_schedule\(0\)` must return a scalar >= 1"
COUNT_MSG = r"^multi_steps.update: `count` must be a finite number >= 0"
COUNT_TYPE_MSG = r"^multi_steps.update: `count` must be an int or float scalar; got"
DLS_MSG = r"^DynamicLossScale: `{}` must be"
MAX_NORM_MSG = r"^multi_steps: `max_grad_norm` must be None or a"
UNBOUND_MSG = r"^multi_steps: axis_name '{}' is not bound here"


def nonfinite_raise():
    tx = jaxaccum.multi_steps(optax.sgd(0.1), 1, nonfinite="raise")
    _, state = jax.jit(lambda g, s: tx.update(g, s, PARAMS, count=1.0))(
        {"w": jnp.full(2, jnp.nan)}, tx.init(PARAMS)
    )
    jax.block_until_ready(state)


def axis_name_unbound(jit):
    tx = sgd(axis_name="data")
    fn = lambda s: tx.update(GRADS, s, PARAMS, count=1.0)
    return (jax.jit(fn) if jit else fn)(tx.init(PARAMS))


def mesh4():
    return jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))


def shard_map_step(tx, grad_fn, mesh_axis="data"):
    """Runs one tx.update per device of a 4-device mesh on y = [0, 1, 2, 3]."""
    mesh = mesh4()
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, PARAMS), mesh_axis)
    # jitted: an eager shard_map dispatches op by op (seconds on CPU)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(PARAMS)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(mesh_axis)), out_specs=specs)
    def step(params, state, y):
        (loss_sum, count), grads = grad_fn(params, y)
        return tx.update(grads, state, params, count=count, loss_sum=loss_sum)[1]

    y = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P(mesh_axis)))
    return step(PARAMS, state, y)


def per_device_loss(params, y):
    # this device's summed loss over its one element, count = 1 + y (varying)
    return jnp.sum((params["w"] - y) ** 2), 1.0 + jnp.sum(y)


def grads_summed_by_autodiff():
    # differentiating w.r.t. replicated params: JAX psums the gradient per call
    grad_fn = jax.value_and_grad(per_device_loss, has_aux=True)
    shard_map_step(sgd(axis_name="data"), lambda p, y: grad_fn(p, y))


def mismatched_axis_name():
    # the optimizer psums over "batch"; the mesh axis is "data"
    grad_fn = jaxaccum.value_and_grad(per_device_loss, axis_name="data")
    shard_map_step(sgd(axis_name="batch"), grad_fn)


def state_without_axis_to_tx_with_axis():
    plain_state = sgd().init(PARAMS)
    tx = sgd(axis_name="data")
    jax.vmap(lambda g: tx.update(g, plain_state, PARAMS, count=1.0), axis_name="data")(
        {"w": jnp.ones((4, 2))}
    )


RAISES = [
    # --- multi_steps(...) construction ---
    ("k_zero", lambda: sgd(0), ValueError, r"^multi_steps: `every_k_schedule` must be >= 1"),
    ("k_negative", lambda: sgd(-3), ValueError, r"^multi_steps: `every_k_schedule` must be >= 1"),
    ("k_float", lambda: sgd(2.5), TypeError, K_MSG + r" a positive int or a callable"),
    ("k_float_integral", lambda: sgd(3.0), TypeError, K_MSG + r" a positive int or a callable"),
    ("k_bool", lambda: sgd(True), TypeError, K_MSG + r" a positive int or a callable"),
    ("k_str", lambda: sgd("4"), TypeError, K_MSG + r" a positive int or a callable"),
    ("k_none", lambda: sgd(None), TypeError, K_MSG + r" a positive int or a callable"),
    ("schedule_returns_zero", lambda: sgd(lambda u: 0), ValueError, SCHED_MSG),
    ("schedule_returns_vector", lambda: sgd(lambda u: jnp.array([2, 2])), ValueError, SCHED_MSG),
    ("schedule_returns_str", lambda: sgd(lambda u: "2"), ValueError, SCHED_MSG),
    ("schedule_returns_fraction", lambda: sgd(lambda u: 2.5), ValueError, SCHED_MSG + r"; got 2.5"),
    (
        "nonfinite_policy_unknown",
        lambda: sgd(nonfinite="ignore"),
        ValueError,
        r"^multi_steps: `nonfinite` must be 'skip' or 'raise'; got 'ignore'",
    ),
    (
        "nonfinite_policy_none",
        lambda: sgd(nonfinite=None),
        ValueError,
        r"^multi_steps: `nonfinite` must be 'skip' or 'raise'; got None",
    ),
    (
        "loss_scaling_float",
        lambda: sgd(loss_scaling=1024.0),
        TypeError,
        r"^multi_steps: `loss_scaling` must be a jaxaccum.DynamicLossScale or None; got float",
    ),
    (
        "loss_scaling_class_not_instance",
        lambda: sgd(loss_scaling=jaxaccum.DynamicLossScale),
        TypeError,
        r"^multi_steps: `loss_scaling` must be a jaxaccum.DynamicLossScale or None; got type",
    ),
    (
        "max_grad_norm_negative",
        lambda: sgd(max_grad_norm=-1.0),
        ValueError,
        MAX_NORM_MSG + r" finite number > 0; got -1.0",
    ),
    (
        "max_grad_norm_nan",
        lambda: sgd(max_grad_norm=float("nan")),
        ValueError,
        MAX_NORM_MSG + r" finite number > 0; got nan",
    ),
    # refused at construction now (it used to fail only at the first boundary)
    (
        "max_grad_norm_str",
        lambda: sgd(1, max_grad_norm="1"),
        TypeError,
        MAX_NORM_MSG + r" number > 0; got str '1'",
    ),
    (
        "accumulator_dtype_int",
        lambda: sgd(accumulator_dtype=jnp.int32),
        TypeError,
        r"^multi_steps: `accumulator_dtype` must be a real floating dtype .*; got int32",
    ),
    (
        "accumulator_dtype_unknown",
        lambda: sgd(accumulator_dtype="foo").init(PARAMS),
        TypeError,
        r"^data type 'foo' not understood",
    ),
    # --- DynamicLossScale(...) ---
    (
        "dls_init_scale_zero",
        lambda: jaxaccum.DynamicLossScale(init_scale=0.0),
        ValueError,
        DLS_MSG.format("init_scale") + r" a finite float32 number > 0; got 0.0",
    ),
    (
        "dls_init_scale_negative",
        lambda: jaxaccum.DynamicLossScale(init_scale=-1.0),
        ValueError,
        DLS_MSG.format("init_scale"),
    ),
    (
        "dls_init_scale_inf",
        lambda: jaxaccum.DynamicLossScale(init_scale=float("inf")),
        ValueError,
        DLS_MSG.format("init_scale"),
    ),
    (
        "dls_init_scale_nan",
        lambda: jaxaccum.DynamicLossScale(init_scale=float("nan")),
        ValueError,
        DLS_MSG.format("init_scale"),
    ),
    pytest.param(
        "dls_init_scale_overflows_float32",
        lambda: jaxaccum.DynamicLossScale(init_scale=1e39),
        ValueError,
        DLS_MSG.format("init_scale") + r" a finite float32 number > 0; got 1e\+39",
        # numpy warns about the float32 cast before the ValueError
        marks=pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
    ),
    (
        "dls_init_scale_str",
        lambda: jaxaccum.DynamicLossScale(init_scale="1"),
        ValueError,
        DLS_MSG.format("init_scale") + r" a finite float32 number > 0; got '1'",
    ),
    (
        "dls_growth_factor_one",
        lambda: jaxaccum.DynamicLossScale(growth_factor=1.0),
        ValueError,
        DLS_MSG.format("growth_factor") + r" a finite number > 1; got 1.0",
    ),
    (
        "dls_growth_factor_inf",
        lambda: jaxaccum.DynamicLossScale(growth_factor=float("inf")),
        ValueError,
        DLS_MSG.format("growth_factor") + r" a finite number > 1; got inf",
    ),
    (
        "dls_backoff_zero",
        lambda: jaxaccum.DynamicLossScale(backoff_factor=0.0),
        ValueError,
        DLS_MSG.format("backoff_factor") + r" a number in \(0, 1\); got 0.0",
    ),
    (
        "dls_backoff_one",
        lambda: jaxaccum.DynamicLossScale(backoff_factor=1.0),
        ValueError,
        DLS_MSG.format("backoff_factor"),
    ),
    (
        "dls_growth_interval_zero",
        lambda: jaxaccum.DynamicLossScale(growth_interval=0),
        ValueError,
        DLS_MSG.format("growth_interval") + r" an int >= 1",
    ),
    (
        "dls_growth_interval_float",
        lambda: jaxaccum.DynamicLossScale(growth_interval=2.5),
        ValueError,
        DLS_MSG.format("growth_interval"),
    ),
    # --- update(...): count ---
    ("count_missing", lambda: update(), TypeError, r"^multi_steps.update: `count` is required"),
    (
        "count_none",
        lambda: update(count=None),
        TypeError,
        r"^multi_steps.update: `count` is required",
    ),
    ("count_negative", lambda: update(count=-1), ValueError, COUNT_MSG + r".*got -1"),
    ("count_negative_numpy_scalar", lambda: update(count=np.float32(-1.0)), ValueError, COUNT_MSG),
    ("count_nan", lambda: update(count=float("nan")), ValueError, COUNT_MSG),
    ("count_inf", lambda: update(count=float("inf")), ValueError, COUNT_MSG),
    (
        "count_vector",
        lambda: update(count=jnp.ones(2)),
        ValueError,
        r"^multi_steps.update: `count` must be a scalar .*got shape \(2,\)",
    ),
    (
        "count_bool_array",
        lambda: update(count=jnp.array(True)),
        TypeError,
        r"^multi_steps.update: `count` must be an int or float scalar; got dtype bool",
    ),
    (
        "count_complex",
        lambda: update(count=np.complex64(1.0)),
        TypeError,
        r"^multi_steps.update: `count` must be an int or float scalar; got dtype complex64",
    ),
    ("count_str", lambda: update(count="3"), TypeError, COUNT_TYPE_MSG + r" str '3'"),
    ("count_python_bool", lambda: update(count=True), TypeError, COUNT_TYPE_MSG + r" bool True"),
    (
        "count_negative_jax_array",
        lambda: update(count=jnp.array(-1.0)),
        ValueError,
        COUNT_MSG + r".*got -1.0",
    ),
    (
        "count_negative_numpy_0d",
        lambda: update(count=np.array(-1.0)),
        ValueError,
        COUNT_MSG + r".*got -1.0",
    ),
    (
        "count_nan_jax_array",
        lambda: update(count=jnp.array(jnp.nan)),
        ValueError,
        COUNT_MSG + r".*got nan",
    ),
    # --- update(...): grads, loss_sum, end_window ---
    (
        "grads_wrong_structure",
        lambda: update(grads={"v": jnp.ones(2)}, count=1.0),
        ValueError,
        r"^multi_steps.update: `grads` does not have the structure of the parameters passed to init",
    ),
    (
        "grads_list_for_dict",
        lambda: update(grads=[jnp.ones(2)], count=1.0),
        ValueError,
        r"^multi_steps.update: `grads` does not have the structure",
    ),
    (
        "grads_none_leaf",
        lambda: update(grads={"w": None}, count=1.0),
        ValueError,
        r"^multi_steps.update: `grads` does not have the structure",
    ),
    (
        "grads_wrong_leaf_shape",
        lambda: update(grads={"w": jnp.ones(3)}, count=1.0),
        ValueError,
        r"^multi_steps.update: `grads` leaf \['w'\] has shape \(3,\); the state expects \(2,\)",
    ),
    (
        "grads_int_dtype",
        lambda: update(grads={"w": jnp.ones(2, jnp.int32)}, count=1.0),
        TypeError,
        r"^multi_steps.update: `grads` leaf \['w'\] has dtype int32; expected a real floating dtype",
    ),
    (
        "grads_complex_dtype",
        lambda: update(grads={"w": jnp.ones(2, jnp.complex64)}, count=1.0),
        TypeError,
        r"^multi_steps.update: `grads` leaf \['w'\] has dtype complex64; expected a real floating dtype",
    ),
    (
        "loss_sum_vector",
        lambda: update(count=1.0, loss_sum=jnp.ones(2)),
        ValueError,
        r"^multi_steps.update: `loss_sum` must be a scalar; got shape \(2,\)",
    ),
    (
        "end_window_str",
        lambda: update(count=1.0, end_window="no"),
        TypeError,
        r"^multi_steps.update: `end_window` must be a bool scalar; got str 'no'",
    ),
    # --- update(...): state ---
    (
        "state_of_another_optimizer",
        lambda: update(state=optax.adam(1.0).init(PARAMS), count=1.0),
        TypeError,
        r"^multi_steps.update: `state` must be the MultiStepsState returned by init; got tuple",
    ),
    (
        "state_for_other_params",
        lambda: update(state=sgd().init({"v": jnp.zeros(2)}), count=1.0),
        ValueError,
        r"^multi_steps.update: `grads` does not have the structure",
    ),
    (
        "state_with_axis_to_tx_without",
        lambda: update(state=sgd(axis_name="data").init(PARAMS), count=1.0),
        ValueError,
        r"^multi_steps.update: `grads` leaf \['w'\] has shape \(2,\); the state expects"
        r" \(1, 2\) \(a state made with an axis_name carries a leading device axis",
    ),
    (
        "state_without_axis_to_tx_with",
        state_without_axis_to_tx_with_axis,
        ValueError,
        r"^multi_steps.update: the state's window sum \['w'\] has shape \(2,\), without the"
        r" leading device axis .* was this state made by a multi_steps without the same axis_name\?",
    ),
    # --- axis names ---
    (
        "axis_name_unbound_eager",
        partial(axis_name_unbound, jit=False),
        NameError,
        UNBOUND_MSG.format("data"),
    ),
    (
        "axis_name_unbound_jit",
        partial(axis_name_unbound, jit=True),
        NameError,
        UNBOUND_MSG.format("data"),
    ),
    (
        "axis_name_mismatched_in_shard_map",
        mismatched_axis_name,
        NameError,
        UNBOUND_MSG.format("batch"),
    ),
    (
        "grads_already_summed_by_autodiff",
        grads_summed_by_autodiff,
        ValueError,
        r"^multi_steps.update: `grads` leaf \['w'\] is already summed over \['data'\]",
    ),
    # --- helpers ---
    (
        "has_updated_without_state",
        lambda: jaxaccum.has_updated(optax.adam(1.0).init(PARAMS)),
        ValueError,
        r"^has_updated: expected exactly one jaxaccum MultiStepsState .* found 0",
    ),
    (
        "window_metrics_two_states",
        lambda: jaxaccum.window_metrics((sgd().init(PARAMS),) * 2),
        ValueError,
        r"^window_metrics: expected exactly one jaxaccum MultiStepsState .* found 2",
    ),
    # --- run time ---
    (
        "nonfinite_raise_policy",
        nonfinite_raise,
        jax.errors.JaxRuntimeError,
        r"FloatingPointError: jaxaccum.multi_steps\(nonfinite='raise'\): the window ending at"
        r" micro-step 1 has a non-finite gradient or loss",
    ),
]


def row_id(row):
    return row.values[0] if hasattr(row, "values") else row[0]


@pytest.mark.parametrize("name, thunk, error, message", RAISES, ids=[row_id(r) for r in RAISES])
def test_raises(name, thunk, error, message):
    with pytest.raises(error) as excinfo:
        thunk()
    assert re.search(message, str(excinfo.value)), str(excinfo.value)


# --------------------------------------------------------------------------
# Rows handled at run time: each is a function that asserts what happens.
# --------------------------------------------------------------------------


def zero_token_window():
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2)
    inner_before = tx.init(PARAMS).inner_state
    updates, state = run_jitted(tx, [GRADS, GRADS], [0.0, 0.0])
    assert_skipped_clean(updates[-1], state, reason=1, inner_before=inner_before)


def all_nan_gradient():
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2)
    inner_before = tx.init(PARAMS).inner_state
    nan = {"w": jnp.full(2, jnp.nan)}
    updates, state = run_jitted(tx, [nan, nan], [1.0, 2.0], [jnp.nan, jnp.nan])
    assert_skipped_clean(updates[-1], state, reason=2, inner_before=inner_before)
    # loss and norm of a non-finite window are recorded as 0, not NaN (exact)
    assert float(state.last_window.loss) == 0.0 and float(state.last_window.grad_norm) == 0.0


def inf_in_one_micro_batch():
    tx = jaxaccum.multi_steps(optax.adam(0.1), 3)
    inner_before = tx.init(PARAMS).inner_state
    grads = [GRADS, {"w": jnp.array([1.0, jnp.inf])}, GRADS]
    updates, state = run_jitted(tx, grads, [1.0, 2.0, 3.0])
    assert_skipped_clean(updates[-1], state, reason=2, inner_before=inner_before)


def nan_in_loss_only():
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2)
    inner_before = tx.init(PARAMS).inner_state
    # the gradient is finite; only the reported loss is NaN: the window is not trusted
    updates, state = run_jitted(tx, [GRADS, GRADS], [1.0, 1.0], [1.0, jnp.nan])
    assert_skipped_clean(updates[-1], state, reason=2, inner_before=inner_before)


def overflow_with_loss_scaling():
    scaling = jaxaccum.DynamicLossScale(init_scale=2.0**8, growth_interval=100)
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2, loss_scaling=scaling)
    inner_before = tx.init(PARAMS).inner_state
    updates, state = run_jitted(tx, [GRADS, {"w": jnp.full(2, jnp.inf)}], [1.0, 1.0])
    assert_skipped_clean(updates[-1], state, reason=2, inner_before=inner_before)
    assert float(jaxaccum.loss_scale(state)) == 2.0**7  # backed off once (exact)


def negative_traced_count_empty_window():
    # documented: a traced count is not checked per call; a window whose global
    # count is not positive is skipped as empty
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2)
    inner_before = tx.init(PARAMS).inner_state
    updates, state = run_jitted(tx, [GRADS, GRADS], [1.0, -1.0])
    assert_skipped_clean(updates[-1], state, reason=1, inner_before=inner_before)


def nan_traced_count():
    # a NaN window count makes the window non-finite: skipped, nothing NaN kept
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2)
    inner_before = tx.init(PARAMS).inner_state
    updates, state = run_jitted(tx, [GRADS, GRADS], [jnp.nan, 1.0])
    assert_skipped_clean(updates[-1], state, reason=2, inner_before=inner_before)
    assert float(jaxaccum.window_metrics(state)["window_count"]) == 0.0  # exact


def inf_traced_count():
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2)
    inner_before = tx.init(PARAMS).inner_state
    updates, state = run_jitted(tx, [GRADS, GRADS], [jnp.inf, 1.0])
    assert_skipped_clean(updates[-1], state, reason=2, inner_before=inner_before)
    assert float(jaxaccum.window_metrics(state)["window_count"]) == 0.0  # exact


def schedule_zero_after_first_update():
    # a traced k cannot be checked at trace time; k < 1 closes every call's
    # window, i.e. behaves as k = 1 (documented here, not an error)
    tx = sgd(lambda update_id: jnp.where(update_id < 1, 2, 0))
    _, state = run_jitted(tx, [GRADS] * 5, [1.0] * 5)
    # windows: [1 2] [3] [4] [5] -> 4 updates (exact integer counters)
    assert int(state.update_id) == 4 and int(state.window_step) == 0


def grads_python_float_leaf():
    # a Python float is a valid scalar gradient: accepted as float32 (exact)
    updates, state = update(grads={"w": 1.0}, params={"w": jnp.zeros(())}, count=1.0)
    assert float(state.grad_sum["w"]) == 1.0 and float(updates["w"]) == 0.0


def inf_on_one_device_shard_map():
    """Under shard_map, device 2 alone sees an inf gradient: every device skips."""
    mesh = mesh4()
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2, axis_name="data")
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, PARAMS), "data")
    # jitted: an eager shard_map dispatches op by op (seconds on CPU)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(PARAMS)
    grad_fn = jaxaccum.value_and_grad(
        lambda p, y, n: (n * jnp.sum((p["w"] - y) ** 2), n), axis_name="data"
    )
    stacked = lambda tree: jax.tree.map(
        lambda x: jax.lax.pcast(x[None], "data", to="varying"), tree
    )

    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), specs, P("data"), P("data")),
        out_specs=(P("data"), P("data"), specs),
    )
    def step(params, state, y, n):
        (loss_sum, count), grads = grad_fn(params, y[0], n[0])
        updates, state = tx.update(grads, state, params, count=count, loss_sum=loss_sum)
        new_params = optax.apply_updates(params, updates)
        # every device's own copy, to check that they agree
        return stacked(new_params), stacked(jaxaccum.window_metrics(state)), state

    put = lambda x: jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, P("data")))
    counts = put([3.0, 1.0, 2.0, 0.0])  # different per device, one with none
    for y in ([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, jnp.inf, 4.0]):  # inf on device 2
        params_per_device, metrics, state = step(PARAMS, state, put(y), counts)
    # every device skipped, and kept the initial params (exact: zero updates)
    np.testing.assert_array_equal(params_per_device["w"], np.zeros((4, 2)))
    np.testing.assert_array_equal(metrics["skip_reason"], [2, 2, 2, 2])
    np.testing.assert_array_equal(metrics["update_id"], [0, 0, 0, 0])
    # a window skipped for an inf gradient still records its global count,
    # 2 x (3 + 1 + 2 + 0) = 12, like torch_ref (exact: small integers)
    np.testing.assert_array_equal(metrics["window_count"], [12.0] * 4)
    assert_finite(state)
    np.testing.assert_array_equal(state.count, np.zeros((4,)))  # every device reset


BEHAVIOURS = [
    ("zero_token_window", zero_token_window),
    ("all_nan_gradient", all_nan_gradient),
    ("inf_in_one_micro_batch", inf_in_one_micro_batch),
    ("nan_in_loss_only", nan_in_loss_only),
    ("overflow_with_loss_scaling", overflow_with_loss_scaling),
    ("grads_python_float_leaf", grads_python_float_leaf),
    ("inf_on_one_device_shard_map", inf_on_one_device_shard_map),
    ("negative_traced_count_empty_window", negative_traced_count_empty_window),
    ("schedule_zero_after_first_update", schedule_zero_after_first_update),
    ("nan_traced_count", nan_traced_count),
    ("inf_traced_count", inf_traced_count),
]


@pytest.mark.parametrize("name, check", BEHAVIOURS, ids=[row_id(r) for r in BEHAVIOURS])
def test_handled_at_run_time(name, check):
    check()


def test_doc_table_lists_exactly_these_rows():
    """docs/bad-inputs.md has one row per test above, and no other."""
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", DOC.read_text(), flags=re.M)
    tested = [row_id(r) for r in RAISES + BEHAVIOURS]
    assert len(documented) == len(set(documented)), "duplicate rows in the doc"
    assert sorted(documented) == sorted(tested)
