"""What a real run needs beyond one exact window, on the routes the docs name.

Each test was written against a way the 0.2.0 wrapper broke on a documented
path: counts that overflow or round in a low-precision accumulator, one
dropout mask for every device under plain ``jit``, fp16 loss scaling that
failed under plain ``jit`` (and, on a summed loss, overflowed ``log2(items)``
windows longer than GradScaler), and a per-block gradient norm for a
tensor-parallel model under ``shard_map``. Updates are SGD (AdamW cannot see a
uniform scale error) and the window records are checked as well.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from testkit import nnx_micro_step

DEVICES = 4
LR = 0.1
rng = np.random.default_rng(0)
PARAMS = {"w": rng.normal(size=(3, 2)).astype(np.float32)}
BATCH = {
    "x": rng.normal(size=(8, 3)).astype(np.float32),
    "y": rng.normal(size=(8, 2)).astype(np.float32),
    "mask": np.array([1, 1, 1, 0, 0, 0, 1, 0], np.float32),  # 3, 0, 1, 0 rows per device
}
# fp32 SGD steps of O(1) gradients summed in another grouping: a few ulps (measured <= 6e-8)
SGD_ATOL = 1e-6


def regression_loss(params, batch, key=None):
    """Masked squared error (a SUM) and its rows; inverted dropout on x with ``key``."""
    x = batch["x"]
    if key is not None:
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        x = jnp.where(keep, 2.0 * x, 0.0)
    per_row = jnp.sum((x @ params["w"] - batch["y"]) ** 2, axis=-1) * batch["mask"]
    return jnp.sum(per_row), jnp.sum(batch["mask"])


def sgd_from(grads):
    return jax.tree.map(lambda p, g: p - LR * g, PARAMS, grads)


def jit_step(tx, loss_fn, *, scaled=False):
    """The README's plain-jit micro-step on the mesh in context."""

    @jax.jit
    def step(params, state, batch, *args):
        scale = jaxaccum.loss_scale(state) if scaled else None
        (loss_sum, num_items), grads = jaxaccum.value_and_grad(loss_fn, axis_name="data")(
            params, batch, *args, loss_scale=scale
        )
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    return step


# -- 2. Counts stay exact in a low-precision accumulator.


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_a_window_of_120004_items_is_counted_exactly_in_a_low_precision_accumulator(dtype):
    # 4 micro-batches of 30001 items: 120004 overflows float16 (65504) and bfloat16
    # counts exactly only to 256 (it would record 119808); float32 counts it exactly
    tx = jaxaccum.multi_steps(optax.sgd(1.0), 4, accumulator_dtype=dtype)
    params = {"w": jnp.zeros(2, dtype)}
    state = tx.init(params)
    for _ in range(4):
        grads = {"w": jnp.full(2, 30001.0 * 0.25, dtype)}  # d(loss_sum)/dw, exact in both
        updates, state = tx.update(grads, state, params, num_items=30001, loss_sum=30001.0)
    record = jaxaccum.window_metrics(state)
    assert state.num_items.dtype == state.loss_sum.dtype == jnp.float32
    assert float(record.window_items) == 120004.0 and not bool(record.skipped)
    assert float(record.loss) == 1.0
    # the gradient sum in `dtype` (4 x 7500.25 rounds there), divided in float32:
    # 0.25 to that dtype's rounding (bf16: 8 bits of mantissa, 2^-9 relative)
    np.testing.assert_allclose(np.asarray(updates["w"], np.float32), -0.25, rtol=2.0**-8)


# -- 3. Dropout under plain jit: each device draws its own mask.


def test_each_device_draws_its_own_dropout_mask_and_the_update_is_their_big_batch():
    mesh = jax.make_mesh((DEVICES,), ("data",))
    tx = jaxaccum.multi_steps(optax.sgd(LR), 1, axis_name="data")
    key = jax.random.key(7)
    with jax.set_mesh(mesh):
        params = jax.device_put(PARAMS, P())
        params, _ = jit_step(tx, regression_loss)(params, tx.init(params),
                                                  jax.device_put(BATCH, P("data")), key)  # fmt: skip
    rows = lambda r: {k: v[2 * r : 2 * r + 2] for k, v in BATCH.items()}  # device r's rows
    drawn = [jax.random.fold_in(key, r) for r in range(DEVICES)]  # what the devices drew
    masks = [np.asarray(jax.random.bernoulli(k, 0.5, (2, 3))) for k in drawn]
    assert len({m.tobytes() for m in masks}) == DEVICES  # four different masks

    def big_batch(p, keys):
        total = sum(regression_loss(p, rows(r), keys[r])[0] for r in range(DEVICES))
        return total / BATCH["mask"].sum()

    expected = sgd_from(jax.grad(big_batch)(PARAMS, drawn))
    np.testing.assert_allclose(jax.device_get(params)["w"], expected["w"], atol=SGD_ATOL)
    same_mask = sgd_from(jax.grad(big_batch)(PARAMS, [key] * DEVICES))  # today's main
    assert np.max(np.abs(jax.device_get(params)["w"] - same_mask["w"])) > 1e-2


def test_an_nnx_module_draws_per_device_and_keeps_its_rng_stream():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.asarray(PARAMS["w"]))
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))

    loss_fn = lambda m, b: regression_loss({"w": m.w[...]}, {**b, "x": m.drop(b["x"])})
    # every device the same rows: equal masks would give equal per-device losses
    same_rows = {k: np.tile(v[:2], (DEVICES, 1)) if v.ndim > 1 else np.ones(8, np.float32)
                 for k, v in BATCH.items()}  # fmt: skip
    mesh = jax.make_mesh((DEVICES,), ("data",))
    with jax.set_mesh(mesh):
        model = Net()
        nnx.update(model, jax.device_put(nnx.state(model), P()))
        key_before = jax.random.key_data(model.drop.rngs.key[...])
        tx = jaxaccum.multi_steps(optax.sgd(LR), 2, axis_name="data")  # the window stays open
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        step = nnx_micro_step(loss_fn, axis_name="data")
        step(model, optimizer, jax.device_put(same_rows, P("data")))
        per_device_loss = np.asarray(optimizer.opt_state.loss_sum[...])  # one row per device
    assert len(set(per_device_loss.tolist())) == DEVICES, per_device_loss  # 4 masks
    key_after = jax.random.key_data(model.drop.rngs.key[...])
    np.testing.assert_array_equal(key_after, key_before)  # the module's key, as it was
    assert int(model.drop.rngs.count[...]) == 1  # one draw per call, not one per device


def test_a_key_closed_over_and_folded_by_hand_draws_as_the_key_passed_in():
    # a closed-over key is refused (docs/bad-inputs.md: key_closed_over_under_jit) unless
    # folded by hand, which is what value_and_grad does to a key passed in: bitwise the same
    key = jax.random.key(7)
    by_hand = lambda p, b: regression_loss(
        p, b, jax.random.fold_in(key, jax.lax.axis_index("data"))
    )
    shared = lambda p, b: regression_loss(p, b, jax.lax.pcast(key, "data", to="varying"))
    with jax.set_mesh(jax.make_mesh((DEVICES,), ("data",))):
        params, batch = jax.device_put(PARAMS, P()), jax.device_put(BATCH, P("data"))
        grads_of = lambda f, *key: jax.jit(jaxaccum.value_and_grad(f, axis_name="data"))(
            params, batch, *key
        )[1]["w"]
        total = lambda g: np.asarray(jax.reshard(g, P()))  # the devices' partial sums added
        passed_in, folded, same = (
            total(grads_of(regression_loss, key)),
            total(grads_of(by_hand)),
            total(grads_of(shared)),
        )
    np.testing.assert_array_equal(folded, passed_in)
    assert np.max(np.abs(same - passed_in)) > 1e-2  # one mask on every device: other rows kept


def test_lax_rng_bit_generator_from_a_shared_key_is_refused_too():
    # not jax.random: lax's own generator, with a closed-over uint32 key, drew the same bits
    # on every device unseen (the check read random_bits only)
    def loss_fn(p, b):
        _, bits = jax.lax.rng_bit_generator(jnp.zeros(4, jnp.uint32), b["x"].shape)
        return regression_loss(p, {**b, "x": b["x"] * (bits % 2).astype(jnp.float32)})

    with jax.set_mesh(jax.make_mesh((DEVICES,), ("data",))):
        params, batch = jax.device_put(PARAMS, P()), jax.device_put(BATCH, P("data"))
        with pytest.raises(ValueError, match="same on every device along \\['data'\\]"):
            jax.jit(jaxaccum.value_and_grad(loss_fn, axis_name="data"))(params, batch)


def test_in_your_shard_map_a_concrete_array_argument_stays_concrete():
    # the draw check traces loss_fn with its traced arguments only: a concrete array used as
    # a size (int(n)) worked before the check and still does (the same gradient, bitwise)
    def loss(p, b, n):
        return regression_loss(p, {k: v[: int(n)] for k, v in b.items()})

    n = jnp.asarray(1)  # each device's first row
    mesh = jax.make_mesh((DEVICES,), ("data",))
    per_device = lambda p, b: jaxaccum.value_and_grad(loss, axis_name="data")(p, b, n)[1]["w"]
    step = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))
    with jax.set_mesh(mesh):
        grads = jax.jit(step)(jax.device_put(PARAMS, P()), jax.device_put(BATCH, P("data")))
    first_rows = {k: v[::2] for k, v in BATCH.items()}  # device r's rows: 2r, 2r + 1
    expected = [
        jax.grad(lambda p, b: regression_loss(p, b)[0])(
            PARAMS, {k: v[r : r + 1] for k, v in first_rows.items()}
        )["w"]
        for r in range(DEVICES)
    ]
    np.testing.assert_array_equal(np.asarray(grads).reshape(DEVICES, 3, 2), np.stack(expected))


def test_a_key_per_row_split_with_the_rows_draws_the_one_device_masks():
    def loss_fn(params, batch):
        keep = jax.vmap(lambda key: jax.random.bernoulli(key, 0.5, (3,)))(batch["key"])
        return regression_loss(params, {**batch, "x": jnp.where(keep, 2.0 * batch["x"], 0.0)})

    batch = {**BATCH, "key": jax.random.split(jax.random.key(7), 8)}  # one per row
    tx = jaxaccum.multi_steps(optax.sgd(LR), 1)
    (loss_sum, items), grads = jaxaccum.value_and_grad(loss_fn)(PARAMS, batch)
    one_device = tx.update(grads, tx.init(PARAMS), PARAMS, num_items=items, loss_sum=loss_sum)
    data_parallel = jaxaccum.multi_steps(optax.sgd(LR), 1, axis_name="data")
    with jax.set_mesh(jax.make_mesh((DEVICES,), ("data",))):
        params = jax.device_put(PARAMS, P())
        step = jit_step(data_parallel, loss_fn)
        params = step(params, data_parallel.init(params), jax.device_put(batch, P("data")))[0]
    # the same masks (keys folded with the device index would draw others): the rows' float32
    # sums in another grouping, SGD_ATOL
    expected = PARAMS["w"] + one_device[0]["w"]
    np.testing.assert_allclose(jax.device_get(params["w"]), expected, atol=SGD_ATOL)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx_jit"])
def test_on_one_device_an_nnx_module_updates_its_dropout_count_and_batch_statistics(jit):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
            self.norm = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

    def loss_fn(m, b):
        out = m.drop(m.norm(m.lin(b["x"])))
        return jnp.sum((out - b["y"]) ** 2), jnp.float32(b["x"].shape[0])

    ours, theirs = Net(), Net()
    wrap = nnx.jit if jit else (lambda f: f)
    (loss, items), grads = wrap(jaxaccum.value_and_grad(loss_fn))(ours, BATCH)
    (loss_ref, _), grads_ref = wrap(nnx.value_and_grad(loss_fn, has_aux=True))(theirs, BATCH)
    # the same function differentiated: float32 of the same operations (1e-6: XLA may fuse
    # them otherwise)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    assert float(items) == 8.0
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
        np.testing.assert_allclose(g, ref, rtol=1e-6, atol=1e-7)
    assert int(ours.drop.rngs.count[...]) == int(theirs.drop.rngs.count[...]) == 1
    np.testing.assert_allclose(ours.norm.mean[...], theirs.norm.mean[...], rtol=1e-6)
    assert float(jnp.abs(ours.norm.mean[...]).max()) > 0  # the statistics moved


def test_the_in_step_scan_draws_a_mask_per_device_too():
    mesh = jax.make_mesh((DEVICES,), ("data",))
    keys = jax.random.split(jax.random.key(5), 2)  # one per micro-batch
    halves = [{k: v[i::2] for k, v in BATCH.items()} for i in range(2)]
    micro = {k: np.stack([h[k] for h in halves]) for k in BATCH}
    loss_fn = lambda p, mb: regression_loss(p, mb, mb["key"])
    with jax.set_mesh(mesh):
        placed = jax.device_put(micro, P(None, "data"))
        grads, metrics = jax.jit(partial(jaxaccum.accumulate_gradients, loss_fn, axis_name="data"))(
            jax.device_put(PARAMS, P()), {**placed, "key": jax.device_put(keys, P())}
        )

    def big_batch(p):  # device r's rows of micro-batch m, with the key that device drew
        total = 0.0
        for m, half in enumerate(halves):
            for r in range(DEVICES):
                rows = {k: v[r : r + 1] for k, v in half.items()}
                total += regression_loss(p, rows, jax.random.fold_in(keys[m], r))[0]
        return total / BATCH["mask"].sum()

    # the window gradient itself: SGD_ATOL's reason, without the step's lr
    np.testing.assert_allclose(jax.device_get(grads)["w"], jax.grad(big_batch)(PARAMS)["w"],
                               atol=SGD_ATOL / LR)  # fmt: skip
    assert float(metrics["window_items"]) == BATCH["mask"].sum()


# -- 4. fp16 loss scaling under plain jit equals the big batch.


def test_loss_scaling_under_plain_jit_is_the_big_batch_and_records_the_window():
    mesh = jax.make_mesh((DEVICES,), ("data",))
    scaling = jaxaccum.DynamicLossScale(init_scale=2.0**10, growth_interval=1)
    tx = jaxaccum.multi_steps(optax.sgd(LR), 2, axis_name="data", loss_scaling=scaling)
    halves = [{k: v[i::2] for k, v in BATCH.items()} for i in range(2)]  # 2 micro-batches
    with jax.set_mesh(mesh):
        params = jax.device_put(PARAMS, P())
        state = tx.init(params)
        step = jit_step(tx, regression_loss, scaled=True)
        for half in halves:
            params, state = step(params, state, jax.device_put(half, P("data")))
    loss_sum, items = regression_loss(PARAMS, BATCH)
    grads = jax.grad(lambda p: regression_loss(p, BATCH)[0] / items)(PARAMS)
    np.testing.assert_allclose(jax.device_get(params)["w"], sgd_from(grads)["w"], atol=SGD_ATOL)
    record = jaxaccum.window_metrics(state)
    assert float(record.window_items) == 4.0 and float(record.loss_scale) == 2.0**11  # grew
    np.testing.assert_allclose(float(record.loss), float(loss_sum / items), rtol=1e-6)
    np.testing.assert_allclose(float(record.grad_norm), float(optax.tree.norm(grads)), rtol=1e-6)


def test_the_loss_scaled_backward_pass_is_sized_like_a_mean_loss():
    # the fp16 backward pass differentiates scale * loss_sum / n (GradScaler's size on a
    # mean loss) and the gradient comes back as that of scale * loss_sum, in float32:
    # here 8 * 4096 * 2w = 196608, past float16's 65504 (the old way: inf, a skipped window)
    f = jaxaccum.value_and_grad(lambda w, n: (n * w**2, n))
    (loss_sum, _), grad = f(jnp.float16(3.0), 4096.0, loss_scale=8.0)
    assert loss_sum.dtype == jnp.float16 and float(loss_sum) == 36864.0
    assert grad.dtype == jnp.float32 and float(grad) == 196608.0  # exact: powers of two
    old_way = jax.grad(lambda w: jnp.float16(8.0) * 4096.0 * w**2)(jnp.float16(3.0))
    assert not bool(jnp.isfinite(old_way))


# -- 5. shard_map with a tensor-parallel model: the window's norm over every block.

TP_PARAMS = {
    "w1": rng.normal(size=(3, 4)).astype(np.float32),
    "w2": rng.normal(size=(4, 2)).astype(np.float32),
    "b": np.zeros(2, np.float32),
}
TP_SPECS = {"w1": P(None, "model"), "w2": P("model", None), "b": P()}
MAX_NORM = 0.5  # below every window's norm (measured 8.4 and 8.0): both windows clip


def tp_loss(params, batch, *, blocks=True):
    """Megatron-style MLP (w1 by columns, w2 by rows); ``blocks``: per device under shard_map."""
    h = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    out = (jax.lax.psum(h, "model") if blocks else h) + params["b"][None]
    per_row = jnp.sum((out - batch["y"]) ** 2, axis=-1) * batch["mask"]
    return jnp.sum(per_row), jnp.sum(batch["mask"])


def tp_run(check_vma=True):
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    tx = jaxaccum.multi_steps(optax.sgd(LR), 2, axis_name="data", max_grad_norm=MAX_NORM)
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, TP_PARAMS), "data", TP_SPECS)
    mapped = partial(jax.shard_map, mesh=mesh, check_vma=check_vma)
    params = jax.device_put(TP_PARAMS, {k: NamedSharding(mesh, s) for k, s in TP_SPECS.items()})
    state = jax.jit(mapped(tx.init, in_specs=(TP_SPECS,), out_specs=specs))(params)

    def body(params, state, batch):
        (loss_sum, n), grads = jaxaccum.value_and_grad(tp_loss, axis_name="data")(params, batch)
        updates, state = tx.update(grads, state, params, num_items=n, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    step = jax.jit(mapped(body, in_specs=(TP_SPECS, specs, P("data")), out_specs=(TP_SPECS, specs)))
    batches = tp_batches()
    for batch in batches:
        params, state = step(params, state, jax.device_put(batch, NamedSharding(mesh, P("data"))))
    return jax.device_get(params), jaxaccum.window_metrics(state), batches


def tp_batches():
    r = np.random.default_rng(1)
    return [{"x": r.normal(size=(8, 3)).astype(np.float32),
             "y": r.normal(size=(8, 2)).astype(np.float32),
             "mask": (r.random(8) < 0.6).astype(np.float32)} for _ in range(4)]  # fmt: skip


def test_tensor_parallel_under_shard_map_clips_by_the_global_norm_like_the_big_batch():
    params, record, batches = tp_run()
    expected = dict(TP_PARAMS)
    mean_loss = lambda p, window: tp_loss(p, window, blocks=False)[0] / window["mask"].sum()
    for w in range(2):
        window = jax.tree.map(lambda *x: np.concatenate(x), *batches[2 * w : 2 * w + 2])
        grads = jax.grad(mean_loss)(expected, window)
        norm = float(optax.tree.norm(grads))
        coef = min(1.0, MAX_NORM / (norm + 1e-6))  # torch's clip_grad_norm_
        expected = jax.tree.map(lambda p, g, c=coef: p - LR * c * g, expected, grads)
    items = window["mask"].sum()
    # the last window's record is the global norm (a block's norm would be smaller)
    np.testing.assert_allclose(float(record.grad_norm), norm, rtol=1e-6)
    assert float(record.window_items) == items
    for name in TP_PARAMS:
        np.testing.assert_allclose(params[name], expected[name], atol=SGD_ATOL)


def test_tensor_parallel_without_vma_checking_is_refused_rather_than_clipped_per_block():
    with pytest.raises(
        ValueError, match=r"check_vma=False on a mesh with other axes \(\['model'\]"
    ):
        tp_run(check_vma=False)
