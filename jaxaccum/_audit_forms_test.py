"""The audit names the global-denominator form and reads clipping as clipping (JAX loops).

The loops (``testkit.audited_loops``) run one SGD update of the unit tests' tiny LM on the
audit's layout of ``jaxaccum/_audit_test.py``'s rows; the expected numbers are computed by
hand here from the layout's items and ``jax.grad`` of the big batch's mean loss.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import bigbatch
import jaxaccum
from jaxaccum._audit_test import (
    FULL,
    FULL_TOKENS,
    PARAMS,
    RESIDUAL_MAX,
    SKEWED,
    WEIGHT_RTOL,
    K,
    assert_recovers,
    audit,
)
from testkit import audited_loops as loops
from testkit import mean_loss, standard_numerics, tiny_lm_loss

pytestmark = pytest.mark.slow  # every audit runs and differentiates a loop: make test only

CLIP = 0.1  # the big batch's gradient norm is 0.204 (FULL) and 0.211 (SKEWED): the clip bites
# the clip scale of a float32 loop: its weights' error, ~1e-6 (measured 3e-7 to 2e-6);
# 1e-5 leaves room
SCALE_RTOL = 1e-5


def big_batch_norm(batch) -> float:
    """``|g|``: the norm of the big batch's gradient, the mean loss over every row's tokens."""
    return float(optax.tree.norm(jax.grad(mean_loss(tiny_lm_loss))(PARAMS, batch)))


# ---- the global denominator ---------------------------------------------------------------------


def test_a_mean_per_global_micro_batch_on_two_devices_by_hand():
    report = audit(loops.mean_of_global_means(tiny_lm_loss, 2), SKEWED, k=K, num_devices=2)
    # the layout: device 0 holds 7, 11, 17, 21 items, device 1 1, 2, 1, 2 (N = 62); a global
    # micro-batch m holds M_m = 8, 13, 18, 23 and each of its items weighs N / (k M_m)
    np.testing.assert_array_equal(report.items, [[7, 11, 17, 21], [1, 2, 1, 2]])
    by_hand = 62 / (4 * np.array([8.0, 13.0, 18.0, 23.0]))
    np.testing.assert_allclose(report.weights, [by_hand, by_hand], rtol=WEIGHT_RTOL)
    assert_recovers(report, "mean_of_global_means")
    assert report.matches == ("mean_of_global_means",)  # not the mean of means (1/(k R n_c))
    assert "a global view: jax.jit on a sharded batch" in str(report), report


def test_a_mean_per_global_micro_batch_on_four_devices():
    report = audit(loops.mean_of_global_means(tiny_lm_loss, 4), SKEWED, k=K, num_devices=4)
    assert_recovers(report, "mean_of_global_means")
    assert report.matches == ("mean_of_global_means",)


def test_on_one_device_the_global_mean_is_the_mean_of_means():
    report = audit(loops.mean_of_global_means(tiny_lm_loss, 1), FULL, k=K)
    assert_recovers(report, "mean_of_means")
    assert report.matches == ("mean_of_means",)  # the global form is not checked apart


# ---- the window clipped once --------------------------------------------------------------------


@pytest.mark.parametrize(
    "window_fn, batch, num_devices",
    [
        (loops.nnx_multi_steps(tiny_lm_loss, K, max_grad_norm=CLIP), FULL, 1),
        (loops.jaxaccum_window(tiny_lm_loss, K, "jit", 2, max_grad_norm=CLIP), SKEWED, 2),
    ],
    ids=["nnx_one_device", "explicit_jit_2"],
)
def test_multi_steps_clipped_once_is_exact_clipped_to_the_threshold(window_fn, batch, num_devices):
    g = big_batch_norm(batch)
    scale = CLIP / (g + 1e-6)  # jaxaccum clips as torch.nn.utils.clip_grad_norm_ does
    kwargs = dict(k=K, num_devices=num_devices, max_grad_norm=CLIP)
    report = audit(window_fn, batch, **kwargs)
    assert report.verdict == "exact" and report.passed and report.clip_kept, report
    assert abs(report.clip_scale - scale) <= SCALE_RTOL * scale
    assert abs(report.clipped_to - scale * g) <= SCALE_RTOL * CLIP
    assert abs(report.grad_norm - g) <= SCALE_RTOL * g
    assert abs(report.scale - scale) <= SCALE_RTOL * scale  # the total weight: s, not 1
    np.testing.assert_allclose(report.verdict_weights[report.items > 0], scale, rtol=SCALE_RTOL)
    assert report.residual <= RESIDUAL_MAX, report
    assert report.summary() == (
        "PASSED, exact: your loop is the big batch clipped once per window to c = 0.1000"
        " (= the max_grad_norm you passed)"
    )
    # told another threshold, the same loop fails: it does not clip to that one
    report = audit(window_fn, batch, **(kwargs | dict(max_grad_norm=0.2)))
    assert report.verdict == "exact" and not report.passed and report.clip_kept is False
    assert "(not the max_grad_norm 0.2 you passed; or every item weighed" in report.summary()


# ---- each micro-batch clipped by its norm -------------------------------------------------------

MICRO_BATCH_CLIP = 1.0  # below every micro-batch's summed-loss gradient norm here: all clip


def test_each_micro_batch_clipped_by_its_norm_is_clipped_per_micro_batch():
    # clip(G_m) = min(1, c / |G_m|) G_m, then / N: in units of 1/N, each micro-batch weighs
    # its clip coefficient, and its share of the gradient is cut to c / N
    report = audit(loops.clipped_per_micro_batch(tiny_lm_loss, MICRO_BATCH_CLIP), k=K)
    assert report.verdict == "clipped_per_micro_batch" and not report.passed, report
    assert report.clip_base == "exact" and report.residual <= RESIDUAL_MAX
    layout = bigbatch.layout_rows(np.array(FULL_TOKENS, float), k=K, num_devices=1)
    cell_grad = lambda ids: jax.grad(
        lambda p: tiny_lm_loss(p, {n: v[ids] for n, v in FULL.items()})[0]
    )
    norms = np.array([float(optax.tree.norm(cell_grad(ids)(PARAMS))) for ids in layout.rows[0]])
    coefficients = np.minimum(1.0, MICRO_BATCH_CLIP / norms)
    assert np.all(coefficients < 0.9)  # the clip bites (else this test would prove nothing)
    np.testing.assert_allclose(report.weights[0], coefficients, rtol=WEIGHT_RTOL)
    np.testing.assert_allclose(report.verdict_weights[0], coefficients, rtol=WEIGHT_RTOL)
    n_window = layout.items.sum()  # 94: clipped before the division by N
    assert abs(report.clipped_to - MICRO_BATCH_CLIP / n_window) <= WEIGHT_RTOL * report.clipped_to
    assert "micro-batches 0, 1, 2, 3 clipped to c = 0.01064 each" in str(report), report


# ---- the invariance audit of a clipped loop -----------------------------------------------------


def clipped_once(params, microbatches, optimizer, *, num_devices=1):
    """``multi_steps(..., max_grad_norm=CLIP)`` on each cut's micro-batches and devices."""
    mode = "jit" if num_devices > 1 else "one_device"
    loop = loops.jaxaccum_window(tiny_lm_loss, len(microbatches), mode, num_devices, CLIP)
    with standard_numerics():
        return loop(params, microbatches, optimizer)


def clipped_each(params, microbatches, optimizer):
    with standard_numerics():
        return loops.clipped_per_micro_batch(tiny_lm_loss, MICRO_BATCH_CLIP)(
            params, microbatches, optimizer
        )


def test_a_window_clipped_once_is_invariant_and_one_clipped_per_micro_batch_is_not():
    invariance = lambda fn, cuts: jaxaccum.audit.audit_invariance(
        fn, PARAMS, FULL, cuts=cuts, loss_fn=tiny_lm_loss, max_grad_norm=CLIP, progress=False
    )
    report = invariance(clipped_once, [(2, 1), (4, 1), (2, 2)])
    assert report.invariant, report
    # the reference: the whole batch clipped to CLIP (|g| = 0.204), as the note says
    assert abs(report.one_batch_norm - CLIP) <= SCALE_RTOL * CLIP
    assert "the max_grad_norm you passed: the whole batch clipped to it" in str(report), report
    report = invariance(clipped_each, [(2, 1), (4, 1)])
    assert not report.invariant and report.worst > 0.1, report  # percents, not rounding


def test_invariance_on_rows_whose_items_are_all_equal_says_so():
    # a mean of means is the mean when every micro-batch holds as many items: on such rows
    # every cut gives the one-batch update, which the report must not leave unsaid
    report = jaxaccum.audit.audit_invariance(
        clipped_each, PARAMS, FULL, cuts=[(2, 1)], row_items=[3] * 16, progress=False
    )
    assert "every row holds 3 items" in report.note, report
    assert (
        "every row holds"
        not in jaxaccum.audit.audit_invariance(
            clipped_each, PARAMS, FULL, cuts=[(2, 1)], loss_fn=tiny_lm_loss, progress=False
        ).note
    )
