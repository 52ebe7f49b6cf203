"""Any split of a window into devices and micro-batches gives the big-batch update.

For k in {1, 2, 4} and devices in {1, 2, 4, 8}, each device with a different
number of valid tokens (one with none), 5 AdamW updates through
``jaxaccum.multi_steps`` equal 5 big-batch AdamW updates, under ``pmap``,
``shard_map`` (with replication checking) and ``jit`` on sharded arrays.
"""

import functools
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._testing import (
    Layout,
    big_batch,
    max_abs_diff,
    skewed_windows,
    tiny_lm_loss,
    tiny_lm_params,
)

NUM_UPDATES = 5
SAMPLES_PER_WINDOW = 32
LEARNING_RATE = 1e-2
# fp32: the layouts add the same per-token gradients in a different order, so
# gradients differ by a few ulps (~1e-7 relative). AdamW's m/sqrt(v) turns a
# relative gradient error e into a relative update error ~e, except where a
# gradient element nearly cancels, where it can reach ~1e-3 of the step. Five
# steps of lr 1e-2 then bound the parameter difference by ~5e-5; measured max
# is ~1e-7. The mean-of-means bug differs by > 1e-3 on the same data (asserted
# below), so this tolerance separates right from wrong by > 20x.
PARAM_ATOL = 5e-5


def adamw() -> optax.GradientTransformation:
    return optax.adamw(LEARNING_RATE, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


@jax.jit
def big_batch_step(params, state, batch):
    def mean_loss(p):
        loss_sum, num_items = tiny_lm_loss(p, batch)
        return loss_sum / num_items

    updates, state = adamw().update(jax.grad(mean_loss)(params), state, params)
    return optax.apply_updates(params, updates), state


def run_big_batch(windows: dict) -> dict:
    """Reference: one plain AdamW step per window on the token-mean loss."""
    params = tiny_lm_params()
    state = adamw().init(params)
    batches = big_batch(windows)
    for w in range(NUM_UPDATES):
        params, state = big_batch_step(params, state, jax.tree.map(lambda x: x[w], batches))
    return params


def local_grads(params, batch, axis_name):
    """Per-device gradient of the summed loss (see multi_steps' shard_map note)."""
    local_params = jax.lax.pcast(params, axis_name, to="varying")
    return jax.value_and_grad(tiny_lm_loss, has_aux=True)(local_params, batch)


def run_shard_map(windows: dict, layout: Layout) -> tuple[dict, list]:
    mesh = jax.make_mesh((layout.devices,), ("data",))
    tx = jaxaccum.multi_steps(adamw(), layout.k, axis_name="data")
    params = jax.device_put(tiny_lm_params(), NamedSharding(mesh, P()))
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, params), "data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), specs, P("data")),
        out_specs=(P(), specs, P()),
    )
    def step(params, state, batch):
        batch = jax.tree.map(lambda x: x[0], batch)  # this device's micro-batch
        (loss_sum, num_items), grads = local_grads(params, batch, "data")
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state, jaxaccum.window_metrics(state)

    records = []
    sharding = NamedSharding(mesh, P("data"))
    for w in range(NUM_UPDATES):
        for m in range(layout.k):
            batch = jax.device_put(jax.tree.map(lambda x: x[w, :, m], windows), sharding)
            params, state, metrics = step(params, state, batch)
        records.append(jax.device_get(metrics))
    return params, records


def run_pmap(windows: dict, layout: Layout) -> dict:
    tx = jaxaccum.multi_steps(adamw(), layout.k, axis_name="data")
    devices = jax.devices()[: layout.devices]
    stacked = jax.tree.map(
        lambda x: np.broadcast_to(x, (layout.devices,) + x.shape), tiny_lm_params()
    )
    params, state = jax.pmap(lambda p: (p, tx.init(p)), axis_name="data", devices=devices)(stacked)

    @partial(jax.pmap, axis_name="data", devices=devices)
    def step(params, state, batch):
        (loss_sum, num_items), grads = jax.value_and_grad(tiny_lm_loss, has_aux=True)(params, batch)
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    for w in range(NUM_UPDATES):
        for m in range(layout.k):
            params, state = step(params, state, jax.tree.map(lambda x: x[w, :, m], windows))
    return jax.tree.map(lambda x: np.asarray(x)[0], params)


def run_explicit_jit(windows: dict, layout: Layout) -> tuple[dict, list]:
    """Plain jax.jit on an Explicit mesh with the axis name: unreduced window sums."""
    mesh = jax.make_mesh((layout.devices,), ("data",))  # Explicit axes: JAX's default
    tx = jaxaccum.multi_steps(adamw(), layout.k, axis_name="data")
    grad_fn = jaxaccum.value_and_grad(tiny_lm_loss, axis_name="data")

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, batch):
        (loss_sum, num_items), grads = grad_fn(params, batch)
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    records = []
    with jax.set_mesh(mesh):
        params = jax.device_put(tiny_lm_params(), P())
        state = tx.init(params)
        for w in range(NUM_UPDATES):
            for m in range(layout.k):
                # the m-th micro-batch of every device, as one global batch split over "data"
                batch = jax.tree.map(lambda x: x[w, :, m].reshape(-1, x.shape[-1]), windows)
                params, state = step(params, state, jax.device_put(batch, P("data")))
            records.append(jax.device_get(jaxaccum.window_metrics(state)))
    return params, records


def run_sharded_jit(windows: dict, layout: Layout) -> dict:
    """Global arrays sharded over the devices; no axis name: sums are global."""
    mesh = jax.make_mesh((layout.devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = jaxaccum.multi_steps(adamw(), layout.k)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(tiny_lm_params(), replicated)
    state = jax.device_put(tx.init(params), replicated)

    @jax.jit
    def step(params, state, batch):
        (loss_sum, num_items), grads = jax.value_and_grad(tiny_lm_loss, has_aux=True)(params, batch)
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    sharding = NamedSharding(mesh, P("data"))
    for w in range(NUM_UPDATES):
        for m in range(layout.k):
            # the m-th micro-batch of every device, as one global batch
            batch = jax.tree.map(lambda x: x[w, :, m].reshape(-1, x.shape[-1]), windows)
            params, state = step(params, state, jax.device_put(batch, sharding))
    return params


LAYOUTS = [
    Layout(devices, k, SAMPLES_PER_WINDOW // (devices * k))
    for devices in (1, 2, 4, 8)
    for k in (1, 2, 4)
]
# pmap and sharded jit share shard_map's accumulation code; to keep the suite
# fast they run on a subset that still holds every k and every device count.
# JAXACCUM_FULL_MATRIX=1 runs all 12 layouts for them too (about 3 minutes).
LAYOUT_SUBSET = (
    LAYOUTS
    if os.environ.get("JAXACCUM_FULL_MATRIX") == "1"
    else [Layout(1, 4, 8), Layout(2, 1, 16), Layout(4, 2, 4), Layout(8, 4, 1)]
)


@functools.cache
def scenario(layout: Layout) -> tuple[dict, dict, np.ndarray]:
    """(windows, big-batch parameters after 5 updates, per-device counts)."""
    windows = skewed_windows(layout, NUM_UPDATES, seed=layout.devices * 10 + layout.k)
    per_device = (
        (windows["labels"][..., 1:] != -100).reshape(NUM_UPDATES, layout.devices, -1).sum(-1)
    )
    return windows, run_big_batch(windows), per_device


layout_id = lambda l: f"dev{l.devices}-k{l.k}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_shard_map_equals_big_batch(layout):
    windows, reference, per_device = scenario(layout)
    # the data really is skewed the way the test promises
    for counts in per_device:
        assert len(set(counts.tolist())) == layout.devices
        if layout.devices > 1:
            assert counts[-1] == 0
    assert max_abs_diff(reference, tiny_lm_params()) > 1e-2  # the steps moved params

    params, records = run_shard_map(windows, layout)
    assert max_abs_diff(params, reference) < PARAM_ATOL

    check_records(records, layout, per_device)


def check_records(records, layout, per_device):
    """The records count the global window: exact integers in float32."""
    expected = per_device.sum(-1)
    np.testing.assert_array_equal([r.window_items for r in records], expected)
    np.testing.assert_array_equal([r.update_id for r in records], np.arange(1, NUM_UPDATES + 1))
    np.testing.assert_array_equal([r.cumulative_items for r in records], np.cumsum(expected))
    np.testing.assert_array_equal(
        [r.micro_step for r in records], layout.k * np.arange(1, NUM_UPDATES + 1)
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_explicit_jit_equals_big_batch(layout):
    windows, reference, per_device = scenario(layout)
    params, records = run_explicit_jit(windows, layout)
    assert max_abs_diff(params, reference) < PARAM_ATOL
    check_records(records, layout, per_device)


@pytest.mark.parametrize("layout", LAYOUT_SUBSET, ids=layout_id)
def test_pmap_equals_big_batch(layout):
    windows, reference, _ = scenario(layout)
    assert max_abs_diff(run_pmap(windows, layout), reference) < PARAM_ATOL


@pytest.mark.parametrize("layout", LAYOUT_SUBSET, ids=layout_id)
def test_sharded_jit_equals_big_batch(layout):
    windows, reference, _ = scenario(layout)
    assert max_abs_diff(run_sharded_jit(windows, layout), reference) < PARAM_ATOL


def test_mean_of_means_is_caught_by_the_tolerance():
    """optax.MultiSteps on per-micro-batch means misses the big batch by >> PARAM_ATOL."""
    layout = Layout(1, 4, 8)
    windows, reference, _ = scenario(layout)
    tx = optax.MultiSteps(adamw(), layout.k)
    params = tiny_lm_params()
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch):
        def mean_loss(p):
            loss_sum, num_items = tiny_lm_loss(p, batch)
            return loss_sum / jnp.maximum(num_items, 1.0)

        updates, state = tx.update(jax.grad(mean_loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    for w in range(NUM_UPDATES):
        for m in range(layout.k):
            params, state = step(params, state, jax.tree.map(lambda x: x[w, 0, m], windows))
    assert max_abs_diff(params, reference) > 20 * PARAM_ATOL
