"""The known forms' weights, checked by hand and against the numbers of ``docs/math.md``."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import bigbatch

# float64 arithmetic on small integers: exact to ~1e-15; 1e-12 is rounding room only
RTOL = 1e-12


def test_hand_checked_window_of_2_devices():
    # device 0: micro-batches of 1 and 3 items; device 1: 0 and 6. N = 10, N_0 = 4, N_1 = 6.
    items = np.array([[1.0, 3.0], [0.0, 6.0]])
    nan = np.nan
    expected = {
        "exact": [[1, 1], [nan, 1]],
        "mean_of_means": [[10 / 4, 10 / 12], [nan, 10 / 24]],  # N / (k R n_c)
        # micro-batch 0 holds 1 + 0 items over both devices, micro-batch 1 3 + 6: N / (k M_m)
        "mean_of_global_means": [[10 / 2, 10 / 18], [nan, 10 / 18]],
        "missing_1_over_k": [[10 / 2, 10 / 6], [nan, 10 / 12]],  # N / (R n_c)
        "local_denominator": [[10 / 8, 10 / 8], [nan, 10 / 12]],  # N / (R N_r)
        "ddp_average_forgotten": [[0.5, 0.5], [nan, 0.5]],  # 1 / R
    }
    for name, weights in expected.items():
        np.testing.assert_allclose(bigbatch.form_weights(name, items, k=2), weights, rtol=RTOL)


def test_the_global_mean_of_means_is_the_mean_of_means_on_one_device():
    items = np.array([[2.0, 5.0, 9.0]])  # M_m = n_m: N / (k M_m) = N / (k R n_c)
    np.testing.assert_allclose(
        bigbatch.form_weights("mean_of_global_means", items, k=3),
        bigbatch.form_weights("mean_of_means", items, k=3),
        rtol=RTOL,
    )


def test_a_short_window_averages_its_own_micro_batches_means():
    # a tail of 2 micro-batches of k = 4: the means averaged over the 2 (docs/math.md
    # section 6: a constant k on top is the fixed divisor's k_tail / k, a second bug)
    items = np.array([[5.0, 7.0], [3.0, 1.0]])  # N = 16, micro-batches of 8 and 8 items
    np.testing.assert_allclose(
        bigbatch.form_weights("mean_of_means", items, k=4),
        [[16 / (2 * 2 * 5), 16 / (2 * 2 * 7)], [16 / (2 * 2 * 3), 16 / (2 * 2 * 1)]],
        rtol=RTOL,
    )
    np.testing.assert_allclose(
        bigbatch.form_weights("mean_of_global_means", items, k=4), np.ones((2, 2)), rtol=RTOL
    )


def test_fixed_divisor_tail_is_k_tail_over_k():
    items = np.array([[5.0, 7.0]])  # a tail of 2 micro-batches of a window of k = 4
    np.testing.assert_allclose(
        bigbatch.form_weights("fixed_divisor_tail", items, k=4), [[0.5, 0.5]], rtol=RTOL
    )


def test_the_numbers_of_the_math_doc():
    # section 2: 10 + 1000 tokens; the mean of means weighs 1/20 and 1/2000 instead of 1/1010
    mom = bigbatch.form_weights("mean_of_means", np.array([[10.0, 1000.0]]), k=2)
    np.testing.assert_allclose(mom, [[1010 / 20, 1010 / 2000]], rtol=RTOL)
    # section 4: 4 devices with 10, 1000, 90 and 0 tokens (k = 2): 27.5x on the first one,
    # and the token weights add up to 0.75
    items = np.array([[4.0, 6.0], [500.0, 500.0], [90.0, 0.0], [0.0, 0.0]])
    local = bigbatch.form_weights("local_denominator", items, k=2)
    assert abs(local[0, 0] - 27.5) <= RTOL * 27.5
    assert abs(np.nansum(local * items) / items.sum() - 0.75) <= RTOL
    # section 5: the forgotten DDP average gives 1/4400 instead of 1/1100: 1/R
    ddp = bigbatch.form_weights("ddp_average_forgotten", items, k=2)
    assert np.nanmax(np.abs(ddp - 0.25)) <= RTOL


@pytest.mark.parametrize(
    "shape, k, forms",
    [
        # one device: the global mean of means is the mean of means, checked under that name
        ((1, 4), 4, ("exact", "mean_of_means", "missing_1_over_k")),
        ((2, 4), 4, bigbatch.FORM_NAMES[:6]),  # no tail: all but fixed_divisor_tail
        # one micro-batch per device: its global mean is the big batch
        (
            (2, 1),
            1,
            (
                "exact",
                "mean_of_means",
                "missing_1_over_k",
                "local_denominator",
                "ddp_average_forgotten",
            ),
        ),  # fmt: skip
        ((1, 2), 4, ("exact", "mean_of_means", "missing_1_over_k", "fixed_divisor_tail")),
        # a one-cell tail: dividing it by its own items is right, and so is its one mean
        ((1, 1), 2, ("exact", "fixed_divisor_tail")),
    ],
)
def test_checkable_forms(shape, k, forms):
    assert bigbatch.checkable_forms(*shape, k=k) == forms


def test_names_are_those_of_torch_ref():
    buggy = pytest.importorskip(
        "torch_ref.buggy", reason="needs torch: no CPU build for this Python here"
    )
    # a DDP loop has no global view of a micro-batch: the global mean of means is JAX's (jit)
    assert set(bigbatch.BUG_NAMES) - {"mean_of_global_means"} <= set(buggy.VARIANTS)
    assert bigbatch.FORM_NAMES == ("exact", *bigbatch.BUG_NAMES)
    # torch_ref's clip_per_microbatch variant audits as this form (torch_ref/_audit_test.py)
    assert bigbatch.CLIP_FORMS == ("clipped_per_micro_batch",)


@pytest.mark.parametrize(
    "name, items, match",
    [
        ("mean", [[1.0, 2.0]], "name: expected one of"),
        ("exact", [1.0, 2.0], "items: expected a non-empty"),
        ("exact", [[1.0, -2.0]], "items: expected a non-empty"),
    ],
)
def test_bad_arguments(name, items, match):
    with pytest.raises(ValueError, match=match):
        bigbatch.form_weights(name, np.array(items), k=2)


def test_bigbatch_imports_numpy_only():
    code = (
        "import sys, bigbatch; frameworks = ('jax', 'torch', 'optax', 'flax');"
        " print(sorted(m for m in sys.modules if m.split('.')[0] in frameworks))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
