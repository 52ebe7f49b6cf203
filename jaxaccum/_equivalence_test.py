"""Any split of a window into devices and micro-batches gives the big-batch update.

For k in {1, 2, 4} and devices in {1, 2, 4, 8}, each device with a different
number of valid tokens (one with none), 5 AdamW updates through
``jaxaccum.multi_steps`` equal 5 big-batch AdamW updates: under plain ``jax.jit``
on an Explicit mesh and under ``shard_map`` (with vma checking) on all 12
layouts, and under ``pmap`` and GSPMD ``jit`` (no axis name) on a subset.
"""

import functools
import os

import numpy as np
import optax
import pytest

import jaxaccum
from testkit import (
    WindowSplit,
    assert_trees_close,
    big_batch,
    big_batch_run,
    data_parallel,
    max_abs_diff,
    skewed_windows,
    standard,
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
REASON = "fp32 sums in another order, through 5 AdamW steps of lr 1e-2"


def adamw() -> optax.GradientTransformation:
    return standard(optax.adamw(LEARNING_RATE, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))


LAYOUTS = [
    WindowSplit(devices, k, SAMPLES_PER_WINDOW // (devices * k))
    for devices in (1, 2, 4, 8)
    for k in (1, 2, 4)
]
FAST = WindowSplit(4, 2, 4)  # the one layout of `make test-fast`; the matrix runs in `make test`


def tiered(layouts):
    return [
        pytest.param(layout, id=layout_id(layout), marks=() if layout == FAST else pytest.mark.slow)
        for layout in layouts
    ]


# pmap and GSPMD share the accumulation code; to keep the suite fast they run on
# a subset that still holds every k and every device count.
# JAXACCUM_FULL_MATRIX=1 runs all 12 layouts for them too (about 3 minutes).
LAYOUT_SUBSET = (
    LAYOUTS
    if os.environ.get("JAXACCUM_FULL_MATRIX") == "1"
    else [WindowSplit(1, 4, 8), WindowSplit(2, 1, 16), WindowSplit(4, 2, 4), WindowSplit(8, 4, 1)]
)


layout_id = lambda layout: f"dev{layout.devices}-k{layout.k}"


@functools.cache
def scenario(layout: WindowSplit) -> tuple[dict, dict, np.ndarray]:
    """(windows, big-batch parameters after 5 updates, per-device items)."""
    windows = skewed_windows(layout, NUM_UPDATES, seed=layout.devices * 10 + layout.k)
    per_device = (
        (windows["labels"][..., 1:] != -100).reshape(NUM_UPDATES, layout.devices, -1).sum(-1)
    )
    batches = [{k: v[w] for k, v in big_batch(windows).items()} for w in range(NUM_UPDATES)]
    return windows, big_batch_run(tiny_lm_params(), batches, tiny_lm_loss, adamw), per_device


def run(mode: str, layout: WindowSplit) -> tuple[dict, list]:
    """5 windows through the README's micro-step in ``mode``; params and records."""
    windows, _, _ = scenario(layout)
    mode = "one_device" if mode == "gspmd" and layout.devices == 1 else mode
    dp = data_parallel(lambda axis: jaxaccum.multi_steps(adamw(), layout.k, axis_name=axis),
                       tiny_lm_loss, mode, layout.devices, donate=True)  # fmt: skip
    params, state = dp.init(tiny_lm_params())
    records = []
    for w in range(NUM_UPDATES):
        for m in range(layout.k):
            batch = {name: value[w, :, m] for name, value in windows.items()}
            params, state = dp.step(params, state, batch)
        records.append(dp.one(jaxaccum.window_metrics(state)))
    return dp.one(params), records


def check_records(records, layout, per_device):
    """The records count the global window: exact integers in float32."""
    expected = per_device.sum(-1)
    np.testing.assert_array_equal([r.window_items for r in records], expected)
    np.testing.assert_array_equal([r.update_id for r in records], np.arange(1, NUM_UPDATES + 1))
    np.testing.assert_array_equal([r.cumulative_items for r in records], np.cumsum(expected))
    np.testing.assert_array_equal(
        [r.micro_step for r in records], layout.k * np.arange(1, NUM_UPDATES + 1)
    )


@pytest.mark.parametrize("layout", tiered(LAYOUTS))
def test_the_data_is_as_skewed_as_promised(layout):
    windows, reference, per_device = scenario(layout)
    for items in per_device:
        assert len(set(items.tolist())) == layout.devices
        if layout.devices > 1:
            assert items[-1] == 0
    assert max_abs_diff(reference, tiny_lm_params()) > 1e-2  # the steps moved params


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
@pytest.mark.parametrize("layout", tiered(LAYOUTS))
def test_every_layout_equals_big_batch(mode, layout):
    _, reference, per_device = scenario(layout)
    params, records = run(mode, layout)
    assert_trees_close(params, reference, atol=PARAM_ATOL, reason=REASON)
    check_records(records, layout, per_device)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pmap", "gspmd"])
@pytest.mark.parametrize("layout", LAYOUT_SUBSET, ids=layout_id)
def test_pmap_and_gspmd_equal_big_batch(mode, layout):
    _, reference, per_device = scenario(layout)
    params, records = run(mode, layout)
    assert_trees_close(params, reference, atol=PARAM_ATOL, reason=REASON)
    check_records(records, layout, per_device)


@pytest.mark.slow  # compiles a model or a multi-device program (> 1 s): make test, not test-fast
def test_mean_of_means_is_caught_by_the_tolerance():
    """optax.MultiSteps on per-micro-batch means misses the big batch by >> PARAM_ATOL."""
    layout = WindowSplit(1, 4, 8)
    windows, reference, _ = scenario(layout)
    batches = [
        {name: value[w, 0, m] for name, value in windows.items()}
        for w in range(NUM_UPDATES)
        for m in range(layout.k)
    ]
    mean_of_means = lambda: standard(optax.MultiSteps(adamw(), layout.k).gradient_transformation())
    params = big_batch_run(tiny_lm_params(), batches, tiny_lm_loss, mean_of_means)
    assert max_abs_diff(params, reference) > 20 * PARAM_ATOL
