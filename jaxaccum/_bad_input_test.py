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

import contextlib
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


def sgd(k=2, inner=None, **kwargs):
    """``multi_steps`` of ``inner`` (SGD at 1.0 by default); with ``inner``: its ``init`` too."""
    tx = jaxaccum.multi_steps(inner or optax.sgd(1.0), k, **kwargs)
    if inner is not None:
        tx.init(PARAMS)
    return tx


def update(tx=None, grads=GRADS, state=None, params=PARAMS, **kwargs):
    """One eager ``update`` call on a fresh state."""
    tx = sgd() if tx is None else tx
    state = tx.init(params) if state is None else state
    return tx.update(grads, state, params, **kwargs)


def run_jitted(tx, grads_seq, counts, loss_sums=None, params=PARAMS):
    """Jitted micro-steps with traced counts/losses; returns (updates list, state)."""
    state = tx.init(params)
    step = jax.jit(lambda g, s, n, loss: tx.update(g, s, params, num_items=n, loss_sum=loss))
    loss_sums = [1.0] * len(counts) if loss_sums is None else loss_sums
    all_updates = []
    for grads, count, loss in zip(grads_seq, counts, loss_sums, strict=True):
        updates, state = step(grads, state, jnp.float32(count), jnp.float32(loss))
        all_updates.append(updates)
    return all_updates, state


def assert_finite(state):
    """No NaN/inf in what feeds later windows: sums, counters, inner state.

    The record (``last_window``) is left out: it reports what the closed window
    was, and marks a value it does not have (a loss never passed) as NaN.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(state._replace(last_window=()))[0]:
        assert bool(jnp.all(jnp.isfinite(leaf))), (
            f"state leaf {jax.tree_util.keystr(path)} = {leaf} is not finite"
        )


def assert_skipped_clean(updates, state, reason, inner_before):
    """A skipped window: zero update, no counter moved, sums reset, no NaN kept."""
    # exact: a skipped window's updates are selected zeros, not computed ones
    np.testing.assert_array_equal(updates["w"], 0.0)
    metrics = jaxaccum.window_metrics(state)
    assert bool(metrics.skipped) and int(metrics.skip_reason) == reason
    assert int(metrics.update_id) == 0 and int(metrics.skip_count) == 1
    assert float(metrics.cumulative_items) == 0.0
    assert not bool(jaxaccum.has_updated(state))
    # the inner optimizer did not advance (bitwise: it was not touched)
    jax.tree.map(np.testing.assert_array_equal, state.inner_state, inner_before)
    # the window sums were reset with fresh zeros (exact)
    np.testing.assert_array_equal(state.grad_sum["w"], 0.0)
    assert float(jnp.sum(state.num_items)) == 0.0 and float(jnp.sum(state.loss_sum)) == 0.0
    assert_finite(state)


def nonfinite_raise():
    tx = jaxaccum.multi_steps(optax.sgd(0.1), 1, nonfinite="raise")
    _, state = jax.jit(lambda g, s: tx.update(g, s, PARAMS, num_items=1.0))(
        {"w": jnp.full(2, jnp.nan)}, tx.init(PARAMS)
    )
    jax.block_until_ready(state)


def axis_name_unbound(jit):
    tx = sgd(axis_name="data")
    fn = lambda s: tx.update(GRADS, s, PARAMS, num_items=1.0)
    return (jax.jit(fn) if jit else fn)(tx.init(PARAMS))


def mesh4():
    return jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))


def shard_map_step(tx, grad_fn, mesh_axis="data", end_window=lambda y: False):
    """Runs one tx.update per device of a 4-device mesh on y = [0, 1, 2, 3]."""
    mesh = mesh4()
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, PARAMS), mesh_axis)
    # jitted: an eager shard_map dispatches op by op (seconds on CPU)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(PARAMS)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(mesh_axis)), out_specs=specs)
    def step(params, state, y):
        (loss_sum, num_items), grads = grad_fn(params, y)
        end = end_window(y)
        return tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum,
                         end_window=end)[1]  # fmt: skip

    y = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P(mesh_axis)))
    return step(PARAMS, state, y)


def per_device_loss(params, y):
    # this device's summed loss over its one element, num_items = 1 + y (varying)
    return jnp.sum((params["w"] - y) ** 2), 1.0 + jnp.sum(y)


def grads_summed_by_autodiff(python_int_items=False):
    # differentiating w.r.t. replicated params: JAX psums the gradient per call
    grad_fn = jax.value_and_grad(per_device_loss, has_aux=True)

    def with_python_int_items(params, y):
        (loss_sum, _), grads = grad_fn(params, y)
        return (loss_sum, 2), grads  # the same on every device: it used to pass, R x too large

    shard_map_step(sgd(axis_name="data"), with_python_int_items if python_int_items else grad_fn)


def mismatched_axis_name():
    # the optimizer psums over "batch"; the mesh axis is "data"
    grad_fn = jaxaccum.value_and_grad(per_device_loss, axis_name="data")
    shard_map_step(sgd(axis_name="batch"), grad_fn)


def end_window_varying_in_shard_map():
    # device 0 alone would close its window: a reduction the others never join
    grad_fn = jaxaccum.value_and_grad(per_device_loss, axis_name="data")
    shard_map_step(sgd(axis_name="data"), grad_fn, end_window=lambda y: jnp.sum(y) == 0)


def auto_axis_under_jit():
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        sgd(axis_name="data").init(PARAMS)


@contextlib.contextmanager
def on_explicit_mesh():
    """An Explicit mesh of 4 devices in context, and on it: sgd with axis_name, replicated
    params, their state, 8 rows split over the devices."""
    tx = sgd(axis_name="data")
    with jax.set_mesh(jax.make_mesh((4,), ("data",))):
        params = jax.device_put(PARAMS, P())
        yield tx, params, tx.init(params), jax.device_put(jnp.ones((8, 2)), P("data"))


def replicated_grads_under_explicit_jit():
    with on_explicit_mesh() as (tx, params, state, x):
        # with respect to the replicated params: the partitioner all-reduces every call
        grads_of = lambda p, x: jax.grad(lambda p: jnp.sum(x @ p["w"]))(p)
        jax.jit(lambda p, s, x: tx.update(grads_of(p, x), s, p, num_items=8)[1])(params, state, x)


def unreduced_grads_to_tx_without_axis_name():
    with on_explicit_mesh() as (_, params, _, x):
        tx = sgd()  # no axis_name: nothing would reduce the devices' partial sums
        loss = lambda p, x: (jnp.sum(x @ p["w"]), jnp.float32(x.shape[0]))

        def step(p, s, x):
            (_, items), grads = jaxaccum.value_and_grad(loss, axis_name="data")(p, x)
            return tx.update(grads, s, p, num_items=items)[1]

        jax.jit(step)(params, tx.init(params), x)


def value_and_grad_axis_name_unbound():
    loss = lambda p, x: (jnp.sum(x @ p["w"]), jnp.float32(x.shape[0]))
    jax.jit(jaxaccum.value_and_grad(loss, axis_name="data"))(PARAMS, jnp.ones((8, 2)))


def batch_split_over_its_sequence_axis():
    mesh = jax.make_mesh((4,), ("data",))
    with jax.set_mesh(mesh):
        params = jax.device_put(PARAMS, P())
        tokens = jax.device_put(jnp.ones((8, 4, 2)), P(None, "data"))  # [rows, T, 2], T split
        loss = lambda p, x: (jnp.sum(x @ p["w"]), jnp.float32(x.shape[0] * x.shape[1]))
        jax.jit(jaxaccum.value_and_grad(loss, axis_name="data"))(params, tokens)


def unreduced_items_outside_jit():
    with on_explicit_mesh() as (tx, params, state, x):
        loss = lambda p, x: (jnp.sum(x @ p["w"]), jnp.float32(x.shape[0]))
        (_, items), grads = jax.jit(jaxaccum.value_and_grad(loss, axis_name="data"))(params, x)
        tx.update(grads, state, params, num_items=items)  # eager: the sums are not reduced


def state_made_outside_the_mesh():
    """``tx.init`` called before ``jax.set_mesh``: its sums have one row, not one per device."""
    tx = sgd(axis_name="data")
    state = tx.init(PARAMS)
    with on_explicit_mesh() as (_, params, _, x):
        loss = lambda p, x: (jnp.sum(x @ p["w"]), jnp.float32(x.shape[0]))
        value_and_grad = jaxaccum.value_and_grad(loss, axis_name="data")

        def step(p, s, x):
            (_, items), grads = value_and_grad(p, x)
            return tx.update(grads, s, p, num_items=items)[1]

        jax.jit(step)(params, state, x)


def nnx_batch_statistics_per_device():
    """A BatchNorm without ``axis_name``: each device's statistics of its own rows."""
    from flax import nnx

    with on_explicit_mesh() as (_, _, _, x):
        model = nnx.Sequential(
            nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(0))
        )
        loss = lambda m, x: (jnp.sum(m(x) ** 2), jnp.float32(x.shape[0]))
        nnx.jit(jaxaccum.value_and_grad(loss, axis_name="data"))(model, x)


def nnx_rngs_argument():
    """An ``nnx.Rngs`` handed to ``loss_fn`` beside the batch (flax's ``model(x, rngs=...)``)."""
    from flax import nnx

    loss = lambda w, x, rngs: (jnp.sum(x @ w["w"]), jnp.float32(x.shape[0]))
    jaxaccum.value_and_grad(loss)(PARAMS, jnp.ones((2, 2)), nnx.Rngs(dropout=0))


def nnx_rng_stream_argument():
    """An ``nnx.RngStream`` (``rngs.dropout``) handed to ``loss_fn`` beside the batch."""
    from flax import nnx

    loss = lambda w, x, stream: (jnp.sum(x @ w["w"]), jnp.float32(x.shape[0]))
    jaxaccum.value_and_grad(loss)(PARAMS, jnp.ones((2, 2)), nnx.Rngs(dropout=0).dropout)


def key_closed_over_under_jit():
    """A dropout key that ``loss_fn`` closes over, under ``jit`` on a 4-device mesh."""
    key = jax.random.key(0)

    def loss(p, x):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.sum(jnp.where(keep, x, 0.0) @ p["w"]), jnp.float32(x.shape[0])

    with on_explicit_mesh() as (_, params, _, x):
        jax.jit(jaxaccum.value_and_grad(loss, axis_name="data"))(params, x)


def keys_per_row_replicated():
    """A key per row, made by ``jax.random.split`` inside ``jit``: replicated, not split."""

    def loss(p, batch):
        keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.5, (2,)))(batch["keys"])
        return jnp.sum(jnp.where(keep, batch["x"], 0.0) @ p["w"]), jnp.float32(8)

    def step(p, x, key):
        batch = {"x": x, "keys": jax.random.split(key, 8)}
        return jaxaccum.value_and_grad(loss, axis_name="data")(p, batch)

    with on_explicit_mesh() as (_, params, _, x):
        jax.jit(step)(params, x, jax.random.key(0))


def nnx_module_to_accumulate_gradients():
    from flax import nnx

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    loss_fn = lambda m, mb: (jnp.sum(m(mb)), jnp.float32(mb.shape[0]))
    jaxaccum.accumulate_gradients(loss_fn, model, jnp.ones((2, 3, 2)))


def state_without_axis_to_tx_with_axis():
    plain_state = sgd().init(PARAMS)
    tx = sgd(axis_name="data")
    jax.vmap(lambda g: tx.update(g, plain_state, PARAMS, num_items=1.0), axis_name="data")(
        {"w": jnp.ones((4, 2))}
    )


RAISES = [
    ("k_zero", lambda: sgd(0), ValueError),
    ("k_negative", lambda: sgd(-3), ValueError),
    ("k_float", lambda: sgd(2.5), TypeError),
    ("k_float_integral", lambda: sgd(3.0), TypeError),
    ("k_bool", lambda: sgd(True), TypeError),
    ("k_str", lambda: sgd("4"), TypeError),
    ("k_none", lambda: sgd(None), TypeError),
    ("schedule_returns_zero", lambda: sgd(lambda u: 0), ValueError),
    ("schedule_returns_vector", lambda: sgd(lambda u: jnp.array([2, 2])), ValueError),
    ("schedule_returns_str", lambda: sgd(lambda u: "2"), TypeError),
    ("schedule_returns_fraction", lambda: sgd(lambda u: 2.5), TypeError),
    ("nonfinite_policy_unknown", lambda: sgd(nonfinite="ignore"), ValueError),
    ("nonfinite_policy_none", lambda: sgd(nonfinite=None), ValueError),
    ("loss_scaling_float", lambda: sgd(loss_scaling=1024.0), TypeError),
    (
        "loss_scaling_class_not_instance",
        lambda: sgd(loss_scaling=jaxaccum.DynamicLossScale),
        TypeError,
    ),
    ("max_grad_norm_negative", lambda: sgd(max_grad_norm=-1.0), ValueError),
    ("max_grad_norm_nan", lambda: sgd(max_grad_norm=float("nan")), ValueError),
    ("max_grad_norm_str", lambda: sgd(1, max_grad_norm="1"), TypeError),
    ("accumulator_dtype_int", lambda: sgd(accumulator_dtype=jnp.int32), TypeError),
    ("accumulator_dtype_unknown", lambda: sgd(accumulator_dtype="foo").init(PARAMS), TypeError),
    ("dls_init_scale_zero", lambda: jaxaccum.DynamicLossScale(init_scale=0.0), ValueError),
    ("dls_init_scale_negative", lambda: jaxaccum.DynamicLossScale(init_scale=-1.0), ValueError),
    ("dls_init_scale_inf", lambda: jaxaccum.DynamicLossScale(init_scale=float("inf")), ValueError),
    ("dls_init_scale_nan", lambda: jaxaccum.DynamicLossScale(init_scale=float("nan")), ValueError),
    pytest.param(
        "dls_init_scale_overflows_float32",
        lambda: jaxaccum.DynamicLossScale(init_scale=1e39),
        ValueError,
        marks=pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
    ),
    ("dls_init_scale_str", lambda: jaxaccum.DynamicLossScale(init_scale="1"), TypeError),
    ("dls_growth_factor_one", lambda: jaxaccum.DynamicLossScale(growth_factor=1.0), ValueError),
    (
        "dls_growth_factor_inf",
        lambda: jaxaccum.DynamicLossScale(growth_factor=float("inf")),
        ValueError,
    ),
    ("dls_backoff_zero", lambda: jaxaccum.DynamicLossScale(backoff_factor=0.0), ValueError),
    ("dls_backoff_one", lambda: jaxaccum.DynamicLossScale(backoff_factor=1.0), ValueError),
    ("dls_growth_interval_zero", lambda: jaxaccum.DynamicLossScale(growth_interval=0), ValueError),
    (
        "dls_growth_interval_float",
        lambda: jaxaccum.DynamicLossScale(growth_interval=2.5),
        TypeError,
    ),
    ("num_items_missing", lambda: update(), TypeError),
    ("count_renamed", lambda: update(count=1.0), TypeError),
    ("num_items_none", lambda: update(num_items=None), TypeError),
    ("num_items_negative", lambda: update(num_items=-1), ValueError),
    ("num_items_negative_numpy_scalar", lambda: update(num_items=np.float32(-1.0)), ValueError),
    ("num_items_nan", lambda: update(num_items=float("nan")), ValueError),
    ("num_items_inf", lambda: update(num_items=float("inf")), ValueError),
    ("num_items_vector", lambda: update(num_items=jnp.ones(2)), ValueError),
    ("num_items_bool_array", lambda: update(num_items=jnp.array(True)), TypeError),
    ("num_items_complex", lambda: update(num_items=np.complex64(1.0)), TypeError),
    ("num_items_str", lambda: update(num_items="3"), TypeError),
    ("num_items_python_bool", lambda: update(num_items=True), TypeError),
    ("num_items_negative_jax_array", lambda: update(num_items=jnp.array(-1.0)), ValueError),
    ("num_items_negative_numpy_0d", lambda: update(num_items=np.array(-1.0)), ValueError),
    ("num_items_nan_jax_array", lambda: update(num_items=jnp.array(jnp.nan)), ValueError),
    ("grads_wrong_structure", lambda: update(grads={"v": jnp.ones(2)}, num_items=1.0), ValueError),
    ("grads_list_for_dict", lambda: update(grads=[jnp.ones(2)], num_items=1.0), ValueError),
    ("grads_none_leaf", lambda: update(grads={"w": None}, num_items=1.0), ValueError),
    ("grads_wrong_leaf_shape", lambda: update(grads={"w": jnp.ones(3)}, num_items=1.0), ValueError),
    (
        "grads_int_dtype",
        lambda: update(grads={"w": jnp.ones(2, jnp.int32)}, num_items=1.0),
        TypeError,
    ),
    (
        "grads_float0_of_an_int_param",
        lambda: update(grads={"w": np.zeros(2, jax.dtypes.float0)}, num_items=1.0),
        TypeError,
    ),
    (
        "grads_complex_dtype",
        lambda: update(grads={"w": jnp.ones(2, jnp.complex64)}, num_items=1.0),
        TypeError,
    ),
    ("loss_sum_vector", lambda: update(num_items=1.0, loss_sum=jnp.ones(2)), ValueError),
    ("end_window_str", lambda: update(num_items=1.0, end_window="no"), TypeError),
    ("optax_field_mini_step", lambda: sgd().init(PARAMS).mini_step, AttributeError),
    ("value_of_a_micro_batch", lambda: update(num_items=2.0, value=jnp.array(0.5)), TypeError),
    ("grad_fn_to_the_inner", lambda: update(num_items=2.0, grad_fn=lambda p, b: p), TypeError),
    (
        "inner_optax_multi_steps",
        lambda: sgd(inner=optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation()),
        TypeError,
    ),
    (
        "state_of_another_optimizer",
        lambda: update(state=optax.adam(1.0).init(PARAMS), num_items=1.0),
        TypeError,
    ),
    (
        "state_for_other_params",
        lambda: update(state=sgd().init({"v": jnp.zeros(2)}), num_items=1.0),
        ValueError,
    ),
    (
        "state_with_axis_to_tx_without",
        lambda: update(state=sgd(axis_name="data").init(PARAMS), num_items=1.0),
        ValueError,
    ),
    ("state_without_axis_to_tx_with", state_without_axis_to_tx_with_axis, ValueError),
    ("axis_name_unbound_eager", partial(axis_name_unbound, jit=False), NameError),
    ("axis_name_unbound_jit", partial(axis_name_unbound, jit=True), NameError),
    ("axis_name_mismatched_in_shard_map", mismatched_axis_name, NameError),
    ("end_window_varying_in_shard_map", end_window_varying_in_shard_map, ValueError),
    ("axis_name_on_an_auto_mesh", auto_axis_under_jit, ValueError),
    ("grads_replicated_under_explicit_jit", replicated_grads_under_explicit_jit, ValueError),
    (
        "unreduced_grads_to_tx_without_axis_name",
        unreduced_grads_to_tx_without_axis_name,
        ValueError,
    ),
    ("value_and_grad_axis_name_unbound", value_and_grad_axis_name_unbound, NameError),
    ("batch_split_over_its_sequence_axis", batch_split_over_its_sequence_axis, ValueError),
    ("state_made_outside_the_mesh", state_made_outside_the_mesh, ValueError),
    ("nnx_batch_statistics_per_device", nnx_batch_statistics_per_device, ValueError),
    ("nnx_rngs_argument", nnx_rngs_argument, TypeError),
    ("nnx_rng_stream_argument", nnx_rng_stream_argument, TypeError),
    ("key_closed_over_under_jit", key_closed_over_under_jit, ValueError),
    ("keys_per_row_replicated", keys_per_row_replicated, ValueError),
    ("nnx_module_to_accumulate_gradients", nnx_module_to_accumulate_gradients, TypeError),
    ("unreduced_items_outside_jit", unreduced_items_outside_jit, ValueError),
    ("grads_already_summed_by_autodiff", grads_summed_by_autodiff, ValueError),
    (
        "grads_already_summed_python_int_items",
        partial(grads_summed_by_autodiff, python_int_items=True),
        ValueError,
    ),
    (
        "partition_specs_batch_axis_in_param_specs",
        lambda: jaxaccum.partition_specs(
            jax.eval_shape(sgd(axis_name="data").init, PARAMS), "data", {"w": P("data")}
        ),
        ValueError,
    ),
    (
        "has_updated_without_state",
        lambda: jaxaccum.has_updated(optax.adam(1.0).init(PARAMS)),
        ValueError,
    ),
    (
        "window_metrics_two_states",
        lambda: jaxaccum.window_metrics((sgd().init(PARAMS),) * 2),
        ValueError,
    ),
    ("nonfinite_raise_policy", nonfinite_raise, jax.errors.JaxRuntimeError),
]


def row_id(row):
    return row.values[0] if hasattr(row, "values") else row[0]


def documented_rows() -> dict[str, str]:
    """``{id: what the user gets}`` from the table of ``docs/bad-inputs.md``."""
    rows = re.findall(
        r"^\| `([a-z0-9_]+)` \| .*? \| (.*) \| [^|]* \|$", DOC.read_text(), flags=re.M
    )
    return dict(rows)


@pytest.mark.parametrize("name, thunk, error", RAISES, ids=[row_id(r) for r in RAISES])
def test_raises_the_documented_error(name, thunk, error):
    with pytest.raises(error) as excinfo:
        thunk()
    # the doc quotes the whole error between `` ``, or (long ones) its start then ...
    quoted = re.search(r"`` (.*?) ``", documented_rows()[name])
    assert quoted, f"docs/bad-inputs.md row {name} quotes no error"
    expected, actual = quoted.group(1), f"{error.__name__}: {excinfo.value}"
    if expected.endswith("..."):
        assert actual.startswith(expected[:-3].rstrip()), actual
    else:
        assert actual == expected, actual
    for contained in re.findall(r"contains `(.*?)`", documented_rows()[name]):
        assert contained in actual, actual


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
    # the record says what the window was: NaN loss and norm (they used to read 0.0)
    assert np.isnan(float(state.last_window.loss)) and np.isnan(float(state.last_window.grad_norm))


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


def negative_traced_num_items_empty_window():
    # documented: a traced count is not checked per call; a window whose global
    # count is not positive is skipped as empty
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2)
    inner_before = tx.init(PARAMS).inner_state
    updates, state = run_jitted(tx, [GRADS, GRADS], [1.0, -1.0])
    assert_skipped_clean(updates[-1], state, reason=1, inner_before=inner_before)


def nan_traced_num_items():
    # a NaN window count makes the window non-finite: skipped, nothing NaN kept
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2)
    inner_before = tx.init(PARAMS).inner_state
    updates, state = run_jitted(tx, [GRADS, GRADS], [jnp.nan, 1.0])
    assert_skipped_clean(updates[-1], state, reason=2, inner_before=inner_before)
    assert np.isnan(float(jaxaccum.window_metrics(state).window_items))  # as it was


def inf_traced_num_items():
    tx = jaxaccum.multi_steps(optax.adam(0.1), 2)
    inner_before = tx.init(PARAMS).inner_state
    updates, state = run_jitted(tx, [GRADS, GRADS], [jnp.inf, 1.0])
    assert_skipped_clean(updates[-1], state, reason=2, inner_before=inner_before)
    assert float(jaxaccum.window_metrics(state).window_items) == np.inf  # as it was


def schedule_zero_after_first_update():
    # a traced k cannot be checked at trace time; k < 1 closes every call's
    # window, i.e. behaves as k = 1 (documented here, not an error)
    tx = sgd(lambda update_id: jnp.where(update_id < 1, 2, 0))
    _, state = run_jitted(tx, [GRADS] * 5, [1.0] * 5)
    # windows: [1 2] [3] [4] [5] -> 4 updates (exact integer counters)
    assert int(state.last_window.update_id) == 4 and int(state.window_step) == 0


def grads_python_float_leaf():
    # a Python float is a valid scalar gradient: accepted as float32 (exact)
    updates, state = update(grads={"w": 1.0}, params={"w": jnp.zeros(())}, num_items=1.0)
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
        (loss_sum, num_items), grads = grad_fn(params, y[0], n[0])
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        new_params = optax.apply_updates(params, updates)
        # every device's own copy, to check that they agree
        return stacked(new_params), stacked(jaxaccum.window_metrics(state)), state

    put = lambda x: jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, P("data")))
    counts = put([3.0, 1.0, 2.0, 0.0])  # different per device, one with none
    for y in ([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, jnp.inf, 4.0]):  # inf on device 2
        params_per_device, metrics, state = step(PARAMS, state, put(y), counts)
    # every device skipped, and kept the initial params (exact: zero updates)
    np.testing.assert_array_equal(params_per_device["w"], np.zeros((4, 2)))
    np.testing.assert_array_equal(metrics.skip_reason, [2, 2, 2, 2])
    np.testing.assert_array_equal(metrics.update_id, [0, 0, 0, 0])
    # a window skipped for an inf gradient still records its global count,
    # 2 x (3 + 1 + 2 + 0) = 12, like torch_ref (exact: small integers)
    np.testing.assert_array_equal(metrics.window_items, [12.0] * 4)
    assert_finite(state)
    np.testing.assert_array_equal(state.num_items, np.zeros((4,)))  # every device reset


BEHAVIOURS = [
    ("zero_token_window", zero_token_window),
    ("all_nan_gradient", all_nan_gradient),
    ("inf_in_one_micro_batch", inf_in_one_micro_batch),
    ("nan_in_loss_only", nan_in_loss_only),
    ("overflow_with_loss_scaling", overflow_with_loss_scaling),
    ("grads_python_float_leaf", grads_python_float_leaf),
    ("inf_on_one_device_shard_map", inf_on_one_device_shard_map),
    ("negative_traced_num_items_empty_window", negative_traced_num_items_empty_window),
    ("schedule_zero_after_first_update", schedule_zero_after_first_update),
    ("nan_traced_num_items", nan_traced_num_items),
    ("inf_traced_num_items", inf_traced_num_items),
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
