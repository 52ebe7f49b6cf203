"""The core contract: the big-batch update or a clear error, optax's dtypes, no hidden work.

Each test here was written against a way the 0.1 wrapper broke its promise
(a silent R x update under ``shard_map``, NNX helpers that failed on
``nnx.Optimizer``'s state, updates cast to the parameters' dtype, a loss of
0.0 recorded for windows without ``loss_sum``).
"""

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
from jaxaccum import losses
from testkit import standard
from testkit.hlo import entry_fusions

DEVICES = 4


# -- 1. Gradients that shard_map's autodiff already summed are refused, whatever num_items is.


def shard_map_sgd_step(num_items_of, *, check_vma=True, per_device_grads=False):
    """One micro-step per device of ``loss = sum((w - y)^2)`` on y = [0, 1, 2, 3].

    ``num_items_of(y)`` gives the items each device passes. Returns the
    parameters after a window of k = 1 (SGD, lr 1).
    """
    mesh = jax.make_mesh((DEVICES,), ("data",))
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 1, axis_name="data")
    params = {"w": jnp.zeros(())}
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, params), "data")
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs, check_vma=check_vma)
    state = jax.jit(init)(params)

    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), specs, P("data")),
        out_specs=P(),
        check_vma=check_vma,
    )
    def step(params, state, y):
        loss_fn = lambda p: jnp.sum((p["w"] - y) ** 2)
        if per_device_grads:
            grads = jax.grad(loss_fn)(jax.lax.pcast(params, "data", to="varying"))
        else:  # with respect to the replicated params
            grads = jax.grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params, num_items=num_items_of(y))
        return optax.apply_updates(params, updates)

    y = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("data")))
    return step(params, state, y)


REPLICATED_NUM_ITEMS = {
    "python_int": lambda y: 1,
    "replicated_array": lambda y: jnp.asarray(1.0),
    "per_sample_without_mask": lambda y: losses.per_sample((y - 1.0) ** 2)[1],
    "policy_gradient_bnpo": lambda y: losses.policy_gradient(
        y[None], jnp.ones((1, 1), bool), loss_type="bnpo"
    )[1],
}


@pytest.mark.parametrize("kind", REPLICATED_NUM_ITEMS)
def test_gradients_summed_by_autodiff_are_refused_whatever_num_items_is(kind):
    # 0.1 accepted these: the update came out exactly R = 4 times too large
    with pytest.raises(ValueError, match=r"`grads` leaf \['w'\] is already summed over \['data'\]"):
        shard_map_sgd_step(REPLICATED_NUM_ITEMS[kind])


def test_per_device_gradients_with_replicated_num_items_are_the_big_batch():
    # each device: 1 item, loss (w - y_r)^2 at w = 0, grad -2 y_r; the big batch
    # of 4 items: grad = sum(-2 y) / 4 = -3, so w = 3 after SGD with lr 1 (exact)
    params = shard_map_sgd_step(REPLICATED_NUM_ITEMS["python_int"], per_device_grads=True)
    assert float(params["w"]) == 3.0


def test_without_vma_checking_autodiff_does_not_sum_and_nothing_is_refused():
    # check_vma=False: jax.grad gives each device its own gradient; exact as above
    params = shard_map_sgd_step(REPLICATED_NUM_ITEMS["python_int"], check_vma=False)
    assert float(params["w"]) == 3.0


# -- 2. has_updated / window_metrics / loss_scale on flax.nnx.Optimizer's state.

README_NNX = """
import jax.numpy as jnp, optax, jaxaccum
from flax import nnx

model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
optimizer = nnx.Optimizer(model, jaxaccum.multi_steps(optax.adamw(1e-2), 2), wrt=nnx.Param)


def loss_fn(model, x, y):  # a SUM and its number of items
    return jnp.sum((model(x)[:, 0] - y) ** 2), y.shape[0]


@nnx.jit(donate_argnums=(0, 1))  # model and optimizer: updated in place
def micro_step(model, optimizer, x, y):
    (loss_sum, num_items), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, x, y)
    optimizer.update(model, grads, num_items=num_items, loss_sum=loss_sum)


log = jaxaccum.WindowLog()
for step in range(4):
    micro_step(model, optimizer, jnp.ones((2, 3)) * step, jnp.arange(2.0))
    for record in log.add(optimizer.opt_state):
        print(record)
for record in log.flush():
    print(record)
"""


def readme_block(marker: str) -> str:
    """The code block of README.md that follows ``<!-- marker -->``."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    found = re.search(rf"<!-- {marker} -->\s*```python\n(.*?)```", text, flags=re.S)
    assert found, f"README.md has no code block marked {marker}"
    return found.group(1)


def test_readme_nnx_block_is_the_one_tested():
    assert readme_block("test: nnx") == README_NNX.lstrip("\n")


@pytest.mark.slow  # compiles a model or a multi-device program (> 1 s): make test, not test-fast
def test_readme_nnx_loop_prints_plain_metrics(capsys):
    exec(compile(README_NNX, "README.md (nnx)", "exec"), {})
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 2  # windows of 2 micro-steps: updates 1 and 2, each once
    assert printed[1].startswith("{'micro_step': 4, 'update_id': 2, 'window_items': 4.0")
    assert "OptArray" not in "".join(printed) and "Array" not in "".join(printed)


def test_nnx_helpers_return_plain_arrays_eagerly_and_under_nnx_jit():
    from flax import nnx

    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    scaling = jaxaccum.DynamicLossScale(init_scale=8.0)
    tx = jaxaccum.multi_steps(optax.sgd(0.1), 1, loss_scaling=scaling)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 3)))))(model)
        optimizer.update(model, grads, num_items=1, loss_sum=2.0)
        state = optimizer.opt_state
        return (
            jaxaccum.has_updated(state),
            jaxaccum.window_metrics(state),
            jaxaccum.loss_scale(state),
        )

    for applied, metrics, scale in [step(model, optimizer), (
        jaxaccum.has_updated(optimizer.opt_state),
        jaxaccum.window_metrics(optimizer.opt_state),
        jaxaccum.loss_scale(optimizer.opt_state),
    )]:  # fmt: skip
        assert type(applied) is type(scale) is type(metrics.loss) is type(jnp.zeros(()))
        assert bool(applied) and float(scale) == 8.0 and float(metrics.loss) == 2.0


# -- 3. The updates have the inner optimizer's update dtype, as with optax.MultiSteps.

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


def dtype_cases():
    """optax's mixed-precision MultiSteps cases; three in `make test-fast`, all in `make test`."""
    fast = {("bf16", "fp32", None), ("fp16", "bf16", jnp.float32), ("fp32", "fp16", None)}
    return [
        pytest.param(
            p,
            g,
            mu,
            id=f"params_{p}-grads_{g}-{'adam_mu_fp32' if mu else 'adam'}",
            marks=() if (p, g, mu) in fast else pytest.mark.slow,
        )  # fmt: skip
        for p in DTYPES
        for g in DTYPES
        for mu in (None, jnp.float32)
    ]


@pytest.mark.parametrize("param_dtype, grad_dtype, mu_dtype", dtype_cases())
def test_update_dtypes_and_values_match_optax_multisteps(param_dtype, grad_dtype, mu_dtype):
    # optax's mixed-precision MultiSteps cases; one item per micro-step, so the
    # window gradient is the mean of the k gradients in both
    k = 3
    params = {"w": jnp.linspace(-1, 1, 5, dtype=DTYPES[param_dtype])}
    inner = lambda: optax.adam(0.1, mu_dtype=mu_dtype)
    ours = jaxaccum.multi_steps(inner(), k)
    theirs = standard(optax.MultiSteps(inner(), k).gradient_transformation())
    ours_state, theirs_state = ours.init(params), theirs.init(params)
    ours_update = jax.jit(lambda g, s: ours.update(g, s, params, num_items=1))
    theirs_update = jax.jit(lambda g, s: theirs.update(g, s, params))
    rng = np.random.default_rng(0)
    for micro_step in range(2 * k):
        grads = {"w": jnp.asarray(rng.normal(size=5), DTYPES[grad_dtype])}
        ours_updates, ours_state = ours_update(grads, ours_state)
        theirs_updates, theirs_state = theirs_update(grads, theirs_state)
        assert ours_updates["w"].dtype == theirs_updates["w"].dtype, micro_step
        # both take the mean in float32 and round it to the gradients' dtype (one
        # rounding each, in a different order: 1 ulp of that dtype); adam then
        # divides m by sqrt(v), which keeps a relative error: 2 ulps of the update
        ulp = float(jnp.finfo(theirs_updates["w"].dtype).eps)
        np.testing.assert_allclose(
            np.asarray(ours_updates["w"], np.float32),
            np.asarray(theirs_updates["w"], np.float32),
            rtol=2 * max(ulp, float(jnp.finfo(DTYPES[grad_dtype]).eps)),
            atol=1e-6,
        )
    assert int(jaxaccum.window_metrics(ours_state).update_id) == 2


def test_between_boundaries_the_zeros_have_the_inner_update_dtype():
    params = {"w": jnp.zeros(3, jnp.bfloat16)}
    tx = jaxaccum.multi_steps(optax.sgd(0.1), 2)
    updates, _ = tx.update({"w": jnp.ones(3, jnp.float32)}, tx.init(params), params, num_items=1)
    # sgd of float32 gradients returns float32 updates; apply_updates casts to bf16
    assert updates["w"].dtype == jnp.float32 and not bool(jnp.any(updates["w"]))


# -- 4. A window without loss_sum has no loss: NaN, never a perfect-looking 0.


def test_window_without_loss_sum_records_nan_loss():
    params = {"w": jnp.zeros(2)}
    tx = jaxaccum.multi_steps(optax.sgd(0.1), 2)
    state = tx.init(params)
    for loss_sum in (None, 3.0):  # one call of the window lacks it
        _, state = tx.update({"w": jnp.ones(2)}, state, params, num_items=1, loss_sum=loss_sum)
    assert np.isnan(float(jaxaccum.window_metrics(state).loss))
    assert bool(jaxaccum.has_updated(state))  # the window itself is fine
    for _ in range(2):  # the next window passes it every time: a real loss again
        _, state = tx.update({"w": jnp.ones(2)}, state, params, num_items=2, loss_sum=3.0)
    assert float(jaxaccum.window_metrics(state).loss) == 1.5  # (3 + 3) / 4, exact


# -- 6. The record is typed; skip reasons are an IntEnum.


def test_window_metrics_is_a_named_tuple_for_loggers():
    tx = jaxaccum.multi_steps(optax.sgd(0.1), 1)
    params = {"w": jnp.zeros(2)}
    _, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params, num_items=0)
    metrics = jaxaccum.window_metrics(state)
    assert isinstance(metrics, jaxaccum.WindowMetrics)
    assert list(metrics._asdict()) == list(jaxaccum.WindowMetrics._fields)
    assert metrics.skip_reason == jaxaccum.SkipReason.EMPTY == 1


# -- 7. Between boundaries the compiled micro-step does no inner-optimizer work.


def micro_step_fusions(inner) -> list[str]:
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}
    tx = jaxaccum.multi_steps(inner, 4)

    def micro_step(params, state, x):
        grads = jax.tree.map(lambda p: p * x, params)
        updates, state = tx.update(grads, state, params, num_items=1.0, loss_sum=x)
        return optax.apply_updates(params, updates), state

    compiled = jax.jit(micro_step).lower(params, tx.init(params), jnp.float32(1.0)).compile()
    return entry_fusions(compiled.as_text())


@pytest.mark.slow
def test_micro_step_path_is_the_same_program_for_any_inner_optimizer():
    # the entry computation (what runs between boundaries) adds to the sums and
    # applies a selected zero update; adamw's weight decay and lamb's trust
    # ratio would show up as extra fusions if XLA had hoisted them out of the loop
    sgd = micro_step_fusions(optax.sgd(0.1))
    assert sgd == micro_step_fusions(optax.adamw(0.1, weight_decay=0.1))
    assert sgd == micro_step_fusions(optax.lamb(0.1))
    assert len(sgd) >= 5  # the sums, the counters, the select: the reader sees them


# -- 8. accumulate_gradients keeps all three sums in accumulator_dtype.


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_accumulate_gradients_keeps_counts_in_float32_whatever_the_accumulator(dtype):
    loss_fn = lambda p, b: (jnp.sum(b["n"] * (p - b["y"]) ** 2), jnp.sum(b["n"]))
    batches = {"y": jnp.array([1.0, 5.0]), "n": jnp.array([3.0, 1.0])}
    grads, metrics = jaxaccum.accumulate_gradients(
        loss_fn, jnp.array(0.0), batches, accumulator_dtype=dtype
    )
    assert metrics["loss"].dtype == metrics["window_items"].dtype == jnp.float32
    # small integers and a power-of-two divisor: exact in every float dtype
    assert float(grads) == -4.0 and float(metrics["loss"]) == 7.0


def test_window_metrics_fields_are_the_shared_record_keys():
    import bigbatch

    assert jaxaccum.WindowMetrics._fields == bigbatch.RECORD_KEYS
    assert jaxaccum.SkipReason is bigbatch.SkipReason  # one enum for both frameworks


# -- 9. A float64 accumulator works under strict dtype promotion (the session's setting).


@pytest.mark.parametrize("param_dtype", ["float32", "float64"])
def test_float64_accumulator_with_loss_scaling_and_clipping_under_strict_promotion(param_dtype):
    with jax.enable_x64(True):
        dtype = jnp.dtype(param_dtype)
        tx = jaxaccum.multi_steps(
            optax.sgd(1.0),
            2,
            accumulator_dtype=jnp.float64,
            max_grad_norm=100.0,
            loss_scaling=jaxaccum.DynamicLossScale(init_scale=4.0),
        )
        params = {"w": jnp.zeros(3, dtype)}
        state = tx.init(params)
        step = jax.jit(
            lambda g, s: tx.update(
                g, s, params, num_items=jnp.asarray(2.0, dtype), loss_sum=jnp.asarray(1.0, dtype)
            )
        )
        for _ in range(2):  # each micro-step: loss scaled by 4, so grad sum 4 per item pair
            updates, state = step({"w": jnp.full(3, 4.0, dtype)}, state)
        assert updates["w"].dtype == dtype
        # window sum 8 over 4 items and scale 4: 0.5, exact in both dtypes; sgd(1) negates
        np.testing.assert_array_equal(np.asarray(updates["w"]), np.full(3, -0.5))
