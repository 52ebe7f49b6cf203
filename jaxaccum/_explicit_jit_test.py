"""Plain ``jax.jit`` on an Explicit mesh: exact, and one gradient reduction per window.

The user's step is the README's: ``multi_steps(..., axis_name="data")``,
``tx.init`` under ``jax.set_mesh``, ``jaxaccum.value_and_grad(loss_fn,
axis_name="data")``, no ``shard_map``, ``pcast`` or ``partition_specs``. Each
test checks the update against the big batch and counts the collectives of the
compiled micro-step (``collectives`` reads the HLO: ``entry`` runs on every
call, ``loop`` in the boundary's loop body, once per window).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxaccum
from testkit import (
    WindowSplit,
    assert_records_match,
    big_batch,
    big_batch_last_window,
    big_batch_run,
    lookup,
    max_abs_diff,
    mean_loss,
    nnx_micro_step,
    skewed_windows,
    standard,
    tiny_lm_loss,
    tiny_lm_params,
)
from testkit.hlo import collectives

K = 2
WINDOWS = 3
DEVICES = 4
# fp32, AdamW lr 1e-2, 3 updates: the layouts add the same per-token gradients
# in another order (ulps); AdamW maps a relative gradient error e to a step
# error ~e, up to ~1e-3 of a step where an element nearly cancels; 3 steps of
# 1e-2 bound the parameters by ~3e-5 (measured ~6e-8).
PARAM_ATOL = 3e-5
# the last window's items (exact), loss and gradient norm against the big batch's:
# fp32 sums of O(10) terms in another order after 2 updates (ulps, measured ~1e-7);
# a uniform scale error (R-fold items, a k-fold gradient) is off by >= 50%
RECORD_RTOL = 1e-5
SCALAR_BYTES = 8  # an f32/s32 scalar, or a pair of them


def adamw():
    return standard(optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1))


def big_batch_params(loss_fn, params, batches):
    """The reference: one AdamW step per window on the token mean, no mesh."""
    return big_batch_run(params, batches, loss_fn, adamw)


def gradient_reductions(hlo: str, param_bytes: int) -> dict[str, int]:
    """Reductions (all-reduce, reduce-scatter) of at least a quarter of ``param_bytes``."""
    reductions = ("all-reduce", "reduce-scatter")
    big = [c for c in collectives(hlo) if c["op"] in reductions and c["bytes"] >= param_bytes // 4]
    return {where: sum(c["where"] == where for c in big) for where in ("entry", "loop")}


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# -- The README's plain-jit step, on the tiny LM.


@pytest.fixture(scope="module")
def lm_run():
    mesh = jax.make_mesh((DEVICES,), ("data",))  # Explicit axes: JAX's default
    windows = skewed_windows(WindowSplit(DEVICES, K, 2), WINDOWS, seed=3)
    tx = jaxaccum.multi_steps(adamw(), every_k_schedule=K, axis_name="data")
    with jax.set_mesh(mesh):
        params = jax.device_put(tiny_lm_params(), P())  # replicated
        opt_state = tx.init(params)  # right shardings, no partition_specs
        init_types = jax.tree.map(jax.typeof, opt_state)

        @partial(jax.jit, donate_argnums=(0, 1))
        def micro_step(params, opt_state, batch):  # batch: device_put(..., P("data"))
            (loss_sum, num_items), grads = jaxaccum.value_and_grad(tiny_lm_loss, axis_name="data")(
                params, batch
            )
            updates, opt_state = tx.update(
                grads, opt_state, params, num_items=num_items, loss_sum=loss_sum
            )
            return optax.apply_updates(params, updates), opt_state

        for w in range(WINDOWS):
            for m in range(K):
                batch = jax.tree.map(
                    lambda x, w=w, m=m: x[w, :, m].reshape(-1, x.shape[-1]), windows
                )
                batch = jax.device_put(batch, P("data"))
                params, opt_state = micro_step(params, opt_state, batch)
        hlo = micro_step.lower(params, opt_state, batch).compile().as_text()
    batches = [jax.tree.map(lambda x, w=w: x[w], big_batch(windows)) for w in range(WINDOWS)]
    reference = big_batch_params(tiny_lm_loss, tiny_lm_params(), batches)
    return dict(params=params, state=opt_state, hlo=hlo, init_types=init_types,
                reference=reference, windows=windows)  # fmt: skip


def test_plain_jit_step_is_the_big_batch(lm_run):
    assert max_abs_diff(jax.device_get(lm_run["params"]), lm_run["reference"]) < PARAM_ATOL
    assert int(jaxaccum.window_metrics(lm_run["state"]).update_id) == WINDOWS


def test_init_under_the_mesh_gives_every_leaf_its_sharding(lm_run):
    types = lm_run["init_types"]
    for leaf in jax.tree.leaves((types.grad_sum, types.loss_sum, types.num_items)):
        # the window's sums: one row of partial sums per device, an ordinary sharded array
        assert leaf.shape[0] == DEVICES and leaf.sharding.spec[0] == "data", leaf
        assert not leaf.sharding.spec.unreduced, leaf
    for leaf in jax.tree.leaves((types.inner_state, types.last_window)):  # replicated
        assert leaf.sharding.spec == P(*(None,) * leaf.ndim), leaf


def test_plain_jit_step_reduces_the_gradient_once_per_window(lm_run):
    found = collectives(lm_run["hlo"])
    # nothing on every call: the gradient, the loss and the items stay partial sums
    assert [c for c in found if c["where"] == "entry"] == []
    # at the boundary, one all-reduce of the gradient sums, the loss and the items
    # together (XLA combines the three reshards), in the boundary's loop body
    big = [c for c in found if c["bytes"] > SCALAR_BYTES]
    assert [(c["op"], c["where"]) for c in big] == [("all-reduce", "loop")]
    assert tree_bytes(tiny_lm_params()) <= big[0]["bytes"] <= tree_bytes(tiny_lm_params()) + 8


# -- Wrong setups get errors that name the fix.


def test_an_auto_axis_is_refused_with_the_fix():
    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = jaxaccum.multi_steps(optax.sgd(0.1), K, axis_name="data")
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="make the axis Explicit"):
        tx.init({"w": jnp.zeros(3)})


def test_replicated_gradients_are_refused_under_explicit_jit():
    mesh = jax.make_mesh((DEVICES,), ("data",))
    tx = jaxaccum.multi_steps(optax.sgd(0.1), K, axis_name="data")
    with jax.set_mesh(mesh):
        params = jax.device_put({"w": jnp.zeros(3)}, P())
        state = tx.init(params)
        x = jax.device_put(jnp.ones((8, 3)), P("data"))

        @jax.jit
        def step(params, state, x):
            # with respect to replicated params: the partitioner all-reduces this call
            grads = jax.grad(lambda p: jnp.sum(x @ p["w"]))(params)
            return tx.update(grads, state, params, num_items=8)[1]

        with pytest.raises(
            ValueError, match=r"jaxaccum.value_and_grad\(loss_fn, axis_name='data'\)"
        ):
            step(params, state, x)


def test_a_state_made_outside_the_mesh_is_refused_and_restore_state_brings_it_over():
    """A state from ``tx.init`` outside the mesh has one row per sum: broadcast against
    the mesh's rows, its open window would join once per device (here its 3 items would
    count 4 times: 20 items in the window, not 11). It is refused; ``restore_state``
    carries it over exactly, and the same state as host numpy arrays is laid out by jit."""
    mesh = jax.make_mesh((DEVICES,), ("data",))
    tx = jaxaccum.multi_steps(optax.sgd(0.1), K, axis_name="data")
    outside = tx.init({"w": jnp.zeros(3)})  # one device's layout: rows of length 1
    half_window = outside._replace(
        window_step=jnp.int32(1),
        grad_sum={"w": jnp.full((1, 3), 6.0)},
        loss_sum=jnp.full((1,), 2.0),
        num_items=jnp.full((1,), 3.0),
    )
    loss_fn = lambda p, x: (jnp.sum(x @ p["w"]), jnp.float32(x.shape[0]))
    value_and_grad = jaxaccum.value_and_grad(loss_fn, axis_name="data")

    @jax.jit
    def step(params, state, x):
        (loss_sum, num_items), grads = value_and_grad(params, x)
        return tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)

    with jax.set_mesh(mesh):
        params = jax.device_put({"w": jnp.zeros(3)}, P())
        x = jax.device_put(jnp.ones((8, 3)), P("data"))
        with pytest.raises(
            ValueError, match=r"grad_sum\['w'\] has shape \(1, 3\).*one row per device, shape \(4"
        ):
            step(params, half_window, x)
        restored = jaxaccum.restore_state(half_window, like=tx.init(params))
        updates, state = step(params, restored, x)
        host_updates, _ = step(params, jax.device_get(restored), x)
    np.testing.assert_array_equal(np.asarray(host_updates["w"]), np.asarray(updates["w"]))
    record = jaxaccum.window_metrics(state)
    # the window: 3 + 8 items (small integers: exact in float32), gradient sums 6 + 8 per
    # weight; the update -0.1 * 14 / 11 to float32 rounding of the division and the product
    assert float(record.window_items) == 11.0
    np.testing.assert_allclose(np.asarray(updates["w"]), np.full(3, -0.1 * 14 / 11), rtol=1e-6)


# -- Parameter sharding alongside data parallelism, on an MLP with skewed masks.

D_IN, HIDDEN, D_OUT, ROWS = 8, 16, 4, 8  # rows per micro-batch (global)


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(0, 0.5, (D_IN, HIDDEN)), jnp.float32),
        "w2": jnp.asarray(rng.normal(0, 0.5, (HIDDEN, D_OUT)), jnp.float32),
    }


def mlp_batches(seed=1):
    """WINDOWS x K micro-batches; the valid rows are skewed (some micro-batches nearly empty)."""
    rng = np.random.default_rng(seed)
    n = WINDOWS * K
    mask = rng.random((n, ROWS)) < np.linspace(0.1, 0.9, n)[:, None]
    mask[0, :] = False  # a micro-batch with no item
    mask[1, 0] = True
    return [
        {
            "x": rng.normal(size=(ROWS, D_IN)).astype(np.float32),
            "y": rng.normal(size=(ROWS, D_OUT)).astype(np.float32),
            "mask": mask[i],
        }
        for i in range(n)
    ]


def mlp_loss(params, batch, *, gather=lambda w: w, hidden_sharding=None, out_sharding=None):
    """Summed masked squared error and its items; ``gather`` fetches a sharded weight."""
    h = jnp.tanh(jnp.einsum("bi,ih->bh", batch["x"], gather(params["w1"]),
                            out_sharding=hidden_sharding))  # fmt: skip
    out = jnp.einsum("bh,ho->bo", h, gather(params["w2"]), out_sharding=out_sharding)
    per_row = jnp.sum((out - batch["y"]) ** 2, axis=-1)
    return jnp.sum(jnp.where(batch["mask"], per_row, 0.0)), jnp.sum(batch["mask"]).astype(
        jnp.float32
    )


def run_sharded(mesh, param_specs, loss_fn, *, reshard_inner=None):
    """The README's step on ``mesh`` with parameters laid out by ``param_specs``."""
    tx = jaxaccum.multi_steps(adamw(), K, axis_name="data")
    batches = mlp_batches()
    with jax.set_mesh(mesh):
        params = {k: jax.device_put(v, param_specs[k]) for k, v in mlp_params().items()}
        state = tx.init(params)
        if reshard_inner is not None:
            state = state._replace(inner_state=reshard_inner(state.inner_state))
        grad_fn = jaxaccum.value_and_grad(loss_fn, axis_name="data")

        @partial(jax.jit, donate_argnums=(0, 1))
        def micro_step(params, state, batch):
            (loss_sum, num_items), grads = grad_fn(params, batch)
            updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
            return optax.apply_updates(params, updates), state

        for batch in batches:
            params, state = micro_step(params, state, jax.device_put(batch, P("data")))
        hlo = micro_step.lower(params, state, jax.device_put(batch, P("data"))).compile().as_text()
        sum_specs = {k: v.sharding.spec for k, v in state.grad_sum.items()}
    windows = [jax.tree.map(lambda *b: np.concatenate(b), *batches[w * K : (w + 1) * K])
               for w in range(WINDOWS)]  # fmt: skip
    reference = big_batch_params(mlp_loss, mlp_params(), windows)
    # AdamW cannot see a uniform gradient scale: the window's record can
    expected = big_batch_last_window(mlp_params(), windows, mlp_loss, adamw)
    assert_records_match(jaxaccum.window_metrics(state), expected, rtol=RECORD_RTOL,
                         reason="fp32 sums in another order")  # fmt: skip
    return jax.device_get(params), reference, hlo, sum_specs


@pytest.mark.slow
def test_zero1_optimizer_state_sharded_over_data_keeps_one_reduction():
    mesh = jax.make_mesh((DEVICES,), ("data",))
    shard_rows = lambda x: jax.device_put(x, P("data") if x.ndim else P())  # AdamW's moments
    params, reference, hlo, _ = run_sharded(
        mesh, {"w1": P(), "w2": P()}, mlp_loss, reshard_inner=lambda s: jax.tree.map(shard_rows, s)
    )
    assert max_abs_diff(params, reference) < PARAM_ATOL
    reductions = gradient_reductions(hlo, tree_bytes(mlp_params()))
    assert reductions == {"entry": 0, "loop": 1}, reductions  # the window's one all-reduce
    # the updates of the sharded moments are gathered back to the replicated parameters
    gathers = [c for c in collectives(hlo) if c["op"] == "all-gather"]
    assert gathers and all(c["where"] == "loop" for c in gathers)


@pytest.mark.slow
def test_fsdp_parameters_sharded_over_data_are_exact_with_sums_sharded_alike():
    mesh = jax.make_mesh((DEVICES,), ("data",))
    # jaxaccum.value_and_grad gathers the weights for the step (an all-gather) and
    # reduces their gradient onto the shards on every micro-step
    params, reference, hlo, sum_specs = run_sharded(
        mesh, {"w1": P("data"), "w2": P("data")}, mlp_loss
    )
    assert max_abs_diff(params, reference) < PARAM_ATOL
    assert sum_specs == {"w1": P("data", None), "w2": P("data", None)}  # no unreduced copy
    reductions = gradient_reductions(hlo, tree_bytes(mlp_params()) // DEVICES)
    # per micro-step: the gradient reduction FSDP implies (a reduce-scatter, which XLA's
    # CPU backend writes as an all-reduce and a slice); nothing at the boundary
    assert reductions["entry"] >= 1 and reductions["loop"] == 0, reductions


@pytest.mark.slow
def test_tensor_parallel_on_a_2d_mesh_reduces_over_data_once_per_window():
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    # Megatron-style: w1 split by columns, w2 by rows over "model"
    loss_fn = partial(mlp_loss, hidden_sharding=P("data", "model"), out_sharding=P("data", None))
    params, reference, hlo, sum_specs = run_sharded(
        mesh, {"w1": P(None, "model"), "w2": P("model", None)}, loss_fn
    )
    assert max_abs_diff(params, reference) < PARAM_ATOL
    assert sum_specs == {  # a row of partial sums per "data" device, split over "model"
        "w1": P("data", None, "model"),
        "w2": P("data", "model", None),
    }
    # gradient-sized reductions: the window's one, in the loop body; the "model"
    # axis's forward/backward all-reduces are activation-sized (rows x features)
    reductions = gradient_reductions(hlo, tree_bytes(mlp_params()) // 2)
    assert reductions == {"entry": 0, "loop": 1}, reductions


# -- Embedding lookups: one device (jax.make_mesh((1,), ("data",)) on one GPU), and a mesh
# with a model axis, where the parameters are cast to `reduced` over "data".


REPLICATED = P()


def embedding_loss(style: str):
    """The tiny LM's loss with its lookup written ``table[tokens]`` or with the explicit
    output sharding that plain ``jit`` on an Explicit mesh asks for (``testkit.lookup``)."""

    def loss_fn(params, batch):
        table, tokens = params["embed"], batch["tokens"]
        rows = table[tokens] if style == "table[tokens]" else lookup(table, tokens)
        logits = jnp.tanh(rows) @ params["proj"]
        return jaxaccum.losses.causal_lm(logits, batch["labels"])

    return loss_fn


def sgd_window_update(mesh, loss_fn, table_spec=REPLICATED) -> dict:
    """One window of SGD(1) on ``mesh`` (batch split over "data"; the embedding table laid
    out by ``table_spec``), checked against the big batch: the update is minus the window's
    gradient (fp32 sums in another order: 1e-5)."""
    devices = mesh.shape["data"]
    windows = skewed_windows(WindowSplit(devices, K, 2), 1, seed=3)
    tx = jaxaccum.multi_steps(optax.sgd(1.0), K, axis_name="data")
    with jax.set_mesh(mesh):
        params = jax.device_put(tiny_lm_params(), {"embed": table_spec, "proj": P()})
        state = tx.init(params)

        @jax.jit
        def micro_step(params, state, batch):
            (loss_sum, num_items), grads = jaxaccum.value_and_grad(loss_fn, axis_name="data")(
                params, batch
            )
            updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
            return updates, state

        for m in range(K):
            batch = jax.tree.map(lambda x, m=m: x[0, :, m].reshape(-1, x.shape[-1]), windows)
            updates, state = micro_step(params, state, jax.device_put(batch, P("data")))
    assert bool(jaxaccum.has_updated(state))
    whole = jax.tree.map(lambda x: x[0], big_batch(windows))
    expected = jax.grad(mean_loss(loss_fn))(tiny_lm_params(), whole)
    for name, g in expected.items():
        np.testing.assert_allclose(-np.asarray(updates[name]), g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("table_spec", [P(), P("data")], ids=["replicated", "fsdp"])
@pytest.mark.parametrize("style", ["table[tokens]", "out_sharding"])
def test_a_one_device_mesh_takes_an_embedding_lookup_in_either_style(style, table_spec):
    # JAX fails a gather of `reduced` parameters, and its gradient in a one-device manual
    # shard_map: on one device jaxaccum replicates the batch and an FSDP table (free) and
    # declares the gradient a partial sum
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    sgd_window_update(mesh, embedding_loss(style), table_spec)


def test_the_in_step_scan_on_a_one_device_mesh_takes_an_embedding_lookup():
    # accumulate_gradients differentiates each micro-batch by the same route: the window's
    # gradient against the big batch's (fp32 sums in another order: 1e-5)
    loss_fn = embedding_loss("table[tokens]")
    windows = skewed_windows(WindowSplit(1, K, 2), 1, seed=3)
    micro = jax.tree.map(lambda x: x[0, 0], windows)  # [k, rows, seq]: one device's
    with jax.set_mesh(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])):
        params = jax.device_put(tiny_lm_params(), P())
        fn = jax.jit(partial(jaxaccum.accumulate_gradients, loss_fn, axis_name="data"))
        grads, _ = fn(params, jax.device_put(micro, P(None, "data")))
    whole = jax.tree.map(lambda x: x[0], big_batch(windows))
    expected = jax.grad(mean_loss(loss_fn))(tiny_lm_params(), whole)
    for name, g in expected.items():
        np.testing.assert_allclose(np.asarray(grads[name]), g, rtol=1e-5, atol=1e-6)


def test_a_mesh_with_a_model_axis_asks_the_lookup_for_its_out_sharding():
    # plain jit asks it too (a ShardingTypeError); of `reduced` parameters JAX fails with
    # "Using *pspec is dangerous", which jaxaccum explains
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    sgd_window_update(mesh, embedding_loss("out_sharding"))
    with pytest.raises(ValueError, match=r"cast to `reduced`.*table.at\[tokens\].get\(out_sh"):
        sgd_window_update(mesh, embedding_loss("table[tokens]"))


@pytest.mark.parametrize("bias_spec", [P(), P("model")])
def test_a_bias_on_a_mesh_with_a_model_axis_is_explained_and_its_fix_is_exact(bias_spec):
    # the parameters are `reduced` over "data", and JAX refuses one added to batch-sharded
    # activations: jaxaccum notes the cast back on JAX's error, and that cast is exact
    def loss_fn(params, batch, bias=lambda b: b):
        y = batch["x"] @ params["w"] + bias(params["b"])[None, :]
        return jnp.sum(y**2), jnp.float32(y.size)

    cast_back = lambda b: jax.reshard(b, P(*jax.typeof(b).sharding.spec.partitions))
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 6)).astype(np.float32), "b": np.ones(6, np.float32)}
    micro = {"x": rng.normal(size=(K, 8, 4)).astype(np.float32)}  # [k, rows, features]
    whole = {"x": micro["x"].reshape(-1, 4)}
    expected = jax.grad(lambda p: (lambda s, n: s / n)(*loss_fn(p, whole)))(params)
    with jax.set_mesh(jax.make_mesh((DEVICES, 2), ("data", "model"))):
        placed = {"w": jax.device_put(params["w"], P(None, "model")),
                  "b": jax.device_put(params["b"], bias_spec)}  # fmt: skip
        micro = jax.device_put(micro, P(None, "data"))
        scan = lambda f: jax.jit(partial(jaxaccum.accumulate_gradients, f, axis_name="data"))
        grads, _ = scan(partial(loss_fn, bias=cast_back))(placed, micro)
        with pytest.raises(Exception, match="reduced on") as raised:
            scan(loss_fn)(placed, micro)
    assert "jax.reshard(b, jax.P(*jax.typeof(b).sharding.spec.partitions))" in "".join(
        raised.value.__notes__
    )
    # fp32 gradients of O(10): the same terms summed in another order, a few ulps
    for name, g in expected.items():
        np.testing.assert_allclose(np.asarray(grads[name]), g, rtol=1e-5, atol=1e-5)


def test_a_spec_naming_the_batch_axis_in_the_per_device_loss_is_explained():
    # a batch-only mesh of 4: the loss runs in a shard_map, where "data" is Manual, and JAX
    # refuses out_sharding=P("data"); the spec of the indices' own type holds there
    def loss_fn(params, batch):
        rows = params["embed"].at[batch["tokens"]].get(out_sharding=P("data"))
        return jaxaccum.losses.causal_lm(jnp.tanh(rows) @ params["proj"], batch["labels"])

    mesh = jax.make_mesh((DEVICES,), ("data",))
    sgd_window_update(mesh, embedding_loss("out_sharding"))
    with pytest.raises(ValueError, match=r"a Manual axis.*jax.typeof\(tokens\)"):
        sgd_window_update(mesh, loss_fn)


# -- The in-step scan under plain jit.


@pytest.mark.slow
@pytest.mark.parametrize("split", ["rows", "micro-batches"])
def test_accumulate_gradients_under_plain_jit_reduces_once_after_the_scan(split):
    # the docstring's layout splits the rows; a split micro-batch axis gives the same sums
    mesh = jax.make_mesh((DEVICES,), ("data",))
    windows = skewed_windows(WindowSplit(DEVICES, K, 2), 1, seed=5)
    micro = jax.tree.map(lambda x: x[0].transpose(1, 0, 2, 3).reshape(K, -1, x.shape[-1]), windows)
    spec = P(None, "data")
    if split == "micro-batches":  # [k, 8 rows] -> [4k, 2 rows]: k micro-batches per device
        micro = jax.tree.map(lambda x: x.reshape(DEVICES * K, -1, x.shape[-1]), micro)
        spec = P("data")
    with jax.set_mesh(mesh):
        params = jax.device_put(tiny_lm_params(), P())
        fn = jax.jit(partial(jaxaccum.accumulate_gradients, tiny_lm_loss, axis_name="data"))
        grads, metrics = fn(params, jax.device_put(micro, spec))
        hlo = fn.lower(params, jax.device_put(micro, spec)).compile().as_text()
    whole = jax.tree.map(lambda x: x[0], big_batch(windows))
    expected = jax.grad(lambda p: (lambda s, n: s / n)(*tiny_lm_loss(p, whole)))(tiny_lm_params())
    # fp32 gradients of O(1): the same terms in another order, a few ulps
    assert max_abs_diff(jax.device_get(grads), expected) < 1e-6
    grad_reductions = [c for c in collectives(hlo) if c["bytes"] > SCALAR_BYTES]
    assert [(c["op"], c["where"]) for c in grad_reductions] == [("all-reduce", "entry")]


# -- partition_specs for shard_map users with a sharded model.


@pytest.mark.slow
def test_partition_specs_compose_with_the_parameters_specs():
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    tx = jaxaccum.multi_steps(adamw(), K, axis_name="data")
    param_specs = {"w1": P(None, "model"), "w2": P("model", None)}
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, mlp_params()), "data", param_specs)
    assert specs.grad_sum == {"w1": P("data", None, "model"), "w2": P("data", "model", None)}
    adam = specs.inner_state[0]
    assert adam.mu == adam.nu == param_specs and adam.count == P()  # the moments keep it
    assert specs.loss_sum == specs.num_items == P("data") and specs.last_window.loss == P()
    # and shard_map lays a state out with them: each device holds its row and its shard
    params = {k: jax.device_put(v, jax.NamedSharding(mesh, param_specs[k]))
              for k, v in mlp_params().items()}  # fmt: skip
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=(param_specs,), out_specs=specs)
    state = jax.jit(init)(params)
    assert state.grad_sum["w1"].shape == (2, D_IN, HIDDEN)  # one row per "data" device
    assert state.inner_state[0].mu["w1"].sharding.spec == P(None, "model")


# -- Flax NNX under nnx.jit on the mesh.


@pytest.mark.slow
def test_nnx_optimizer_under_nnx_jit_reduces_once_per_window():
    from flax import nnx

    mesh = jax.make_mesh((DEVICES,), ("data",))
    batches = mlp_batches()

    class MLP(nnx.Module):
        def __init__(self):
            params = mlp_params()
            self.w1, self.w2 = nnx.Param(params["w1"]), nnx.Param(params["w2"])

        def __call__(self, x):
            return jnp.tanh(x @ self.w1[...]) @ self.w2[...]

    def loss_fn(model, batch):
        per_row = jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1)
        return jnp.sum(jnp.where(batch["mask"], per_row, 0.0)), jnp.sum(batch["mask"]).astype(
            jnp.float32
        )

    with jax.set_mesh(mesh):
        model = MLP()
        nnx.update(model, jax.device_put(nnx.state(model), P()))
        tx = jaxaccum.multi_steps(adamw(), K, axis_name="data")
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        micro_step = nnx_micro_step(loss_fn, axis_name="data")

        for batch in batches:
            micro_step(model, optimizer, jax.device_put(batch, P("data")))
        hlo = micro_step.lower(model, optimizer, jax.device_put(batch, P("data")))
        hlo = hlo.compile().as_text()
    params = {"w1": np.asarray(model.w1[...]), "w2": np.asarray(model.w2[...])}
    windows = [jax.tree.map(lambda *b: np.concatenate(b), *batches[w * K : (w + 1) * K])
               for w in range(WINDOWS)]  # fmt: skip
    assert max_abs_diff(params, big_batch_params(mlp_loss, mlp_params(), windows)) < PARAM_ATOL
    expected = big_batch_last_window(mlp_params(), windows, mlp_loss, adamw)
    assert_records_match(jaxaccum.window_metrics(optimizer.opt_state), expected,
                         rtol=RECORD_RTOL, reason="fp32 sums in another order")  # fmt: skip
    assert gradient_reductions(hlo, tree_bytes(mlp_params())) == {"entry": 0, "loop": 1}
    assert [c for c in collectives(hlo) if c["where"] == "entry"] == []
