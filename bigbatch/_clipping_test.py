"""Clipping read off the weights: the window clipped once (a form times one factor), and each
micro-batch clipped by its norm (``clipped_per_micro_batch``), on exact float64 reweightings."""

from __future__ import annotations

import math

import numpy as np
import pytest

import bigbatch
from bigbatch._fit_test import RTOL, run, window


def norm(x: np.ndarray) -> float:
    return float(np.linalg.norm(x))


def big_batch_norm(layout, grads) -> float:
    """``|g|``, the norm of the big batch's gradient ``sum_c G_c / N``."""
    return norm(grads.sum(axis=(0, 1)) / layout.items.sum())


@pytest.mark.parametrize("num_devices", [1, 2])
def test_the_window_clipped_once_is_exact_with_its_scale_and_norm(num_devices):
    layout, grads = window(4, num_devices)
    # clip_grad_norm_ at c = 0.6 |g|: every weight 0.6 of the big batch's
    c = 0.6 * big_batch_norm(layout, grads)
    report = run(layout, grads, np.where(layout.items > 0, 0.6, np.nan))
    assert report.verdict == "exact" and report.matches == ("exact",)
    assert abs(report.clip_scale - 0.6) <= RTOL and abs(report.scale - 0.6) <= RTOL
    assert abs(report.clipped_to - c) <= RTOL * c  # the norm of the applied gradient
    assert abs(report.grad_norm - c / 0.6) <= RTOL * c  # |g| before the clip
    # no threshold passed: a clip once per window, or every item weighed 0.6x (a loss divided
    # by k twice): the audit cannot tell, and does not pass it
    assert report.clip_kept is None and not report.passed
    assert report.summary() == (
        f"NOT CONFIRMED, exact: your loop is the big batch clipped once per window to c ="
        f" {c:#.4g} (or every item weighed 0.6x: pass max_grad_norm= your clip threshold, or"
        " math.inf if your loop does not clip, to tell)"
    )
    # told the threshold, the audit says whether it is the one the loop clipped to
    report = run(layout, grads, np.where(layout.items > 0, 0.6, np.nan), max_grad_norm=c)
    assert report.passed and report.clip_kept
    assert "(= the max_grad_norm you passed)" in report.summary()
    # a clip at the threshold erases any constant factor before it: the report says so
    assert "a constant factor before it (a count off, a loss scale not undone) cannot" in str(
        report
    )
    # the summed gradient clipped to the threshold, then divided by N: c N is the threshold
    total = float(layout.items.sum())
    report = run(layout, grads, np.where(layout.items > 0, 0.6, np.nan), max_grad_norm=c * total)
    assert report.clip_kept is False and "c N is the max_grad_norm you passed" in str(report)
    report = run(layout, grads, np.where(layout.items > 0, 0.6, np.nan), max_grad_norm=2 * c)
    assert report.verdict == "exact" and not report.passed and report.clip_kept is False
    # the threshold passed does not explain the clip: a clip at another one, or a count off
    assert (
        f"(not the max_grad_norm {2 * c:g} you passed; or every item weighed 0.6x: a divisor or"
        " a count off by that factor" in report.summary()
    )
    # a loop that does not clip (max_grad_norm=inf): the uniform 0.6 is a bug, read as no clip
    report = run(layout, grads, np.where(layout.items > 0, 0.6, np.nan), max_grad_norm=math.inf)
    assert not report.passed and report.verdict == "unknown" and report.clip_scale == 1.0
    assert (
        report.summary() == "FAILED, unknown: your loop weighs every item at 0.600x the big batch"
    )
    # and the note names what scales every item alike, not a clip per device or another loss
    assert "verdict: unknown: the big batch's weights times 0.6: a divisor" in str(report)


def test_a_threshold_the_window_stays_below_and_one_it_ignores():
    layout, grads = window(4, 1)
    g = big_batch_norm(layout, grads)
    exact = np.where(layout.items > 0, 1.0, np.nan)
    below = run(layout, grads, exact, max_grad_norm=2 * g)  # no clip bites: right
    assert below.passed and below.clip_kept and below.clip_scale == 1.0
    assert "is below the max_grad_norm you passed" in str(below)
    above = run(layout, grads, exact, max_grad_norm=0.5 * g)  # it should have clipped
    assert above.verdict == "exact" and not above.passed and above.clip_kept is False
    assert "but it does not clip it" in above.summary() and "yet it was not clipped" in str(above)


def test_a_clip_at_the_threshold_erases_a_constant_factor():
    # a forgotten DDP average (1/R = 1/2) whose update is then clipped to c: the clip
    # leaves c g/|g|, the big batch clipped, whatever the constant was
    layout, grads = window(4, 2)
    weights = bigbatch.form_weights("ddp_average_forgotten", layout.items, k=4)
    assert run(layout, grads, weights).verdict == "ddp_average_forgotten"  # no threshold told
    c = 0.5 * big_batch_norm(layout, grads)  # the norm of this update
    report = run(layout, grads, weights, max_grad_norm=c)
    assert report.verdict == "exact" and report.passed, report
    assert abs(report.clip_scale - 0.5) <= RTOL


def test_a_bug_clipped_once_keeps_its_name():
    layout, grads = window(4, 1)
    mean_of_means = bigbatch.form_weights("mean_of_means", layout.items, k=4)
    report = run(layout, grads, 0.7 * mean_of_means)  # nanoGPT with grad_clip
    assert report.verdict == "mean_of_means" and not report.passed
    assert abs(report.clip_scale - 0.7) <= RTOL
    np.testing.assert_allclose(report.verdict_weights, 0.7 * mean_of_means, rtol=RTOL)
    assert "mean_of_means, clipped" in str(report).splitlines()[2]  # the table's last column
    # the missing 1/k is k = 4 times the mean of means: clipped by 0.2 it is a mean of means
    # clipped by 0.8 (named first), by 0.7 only a missing 1/k clipped
    missing = bigbatch.form_weights("missing_1_over_k", layout.items, k=4)
    report = run(layout, grads, 0.2 * missing)
    assert report.matches == ("mean_of_means",) and abs(report.clip_scale - 0.8) <= RTOL
    report = run(layout, grads, 0.7 * missing)
    assert report.verdict == "missing_1_over_k" and abs(report.clip_scale - 0.7) <= RTOL


@pytest.mark.parametrize("num_devices", [1, 2])
def test_each_micro_batch_clipped_by_its_norm_is_its_own_form(num_devices):
    layout, grads = window(4, num_devices)
    total = layout.items.sum()
    shares = np.array([norm(grads[:, m].sum(axis=0) / total) for m in range(4)])  # |g_m|
    smallest = np.sort(shares[shares > 0])  # on one device micro-batch 0 has no item
    c = float(smallest[:2].mean())  # the smallest share is added whole, the others clipped
    weights = np.full(layout.items.shape, np.nan)
    full = layout.items > 0
    weights[full] = np.minimum(1.0, c / np.broadcast_to(shares, layout.items.shape)[full])
    report = run(layout, grads, weights)
    assert report.verdict == "clipped_per_micro_batch" and not report.passed, report
    assert "pass max_grad_norm" not in str(report)  # that advice is for a clip once
    assert report.clip_base == "exact" and abs(report.clipped_to - c) <= RTOL * c
    np.testing.assert_allclose(report.verdict_weights, weights, rtol=RTOL)
    assert report.form_errors["clipped_per_micro_batch"] <= RTOL
    clipped = [m for m in range(4) if shares[m] > c]
    assert f"micro-batches {', '.join(map(str, clipped))} clipped to c = {c:#.4g}" in str(report)
    assert "fix: clip the window's gradient once" in str(report)
    report = run(layout, grads, weights, max_grad_norm=c)
    assert report.clip_kept and "= the max_grad_norm you passed" in str(report)
    # a loop said not to clip (max_grad_norm=inf) that clips per micro-batch
    report = run(layout, grads, weights, max_grad_norm=math.inf)
    assert report.clip_kept is False and "= the max_grad_norm you passed" not in str(report)
    assert "you said it does not clip (max_grad_norm=inf)" in str(report)


def test_micro_batch_means_clipped_each_are_a_mean_of_means_clipped_per_micro_batch():
    # optax.chain(clip_by_global_norm(c), optax.MultiSteps(...)) fed each micro-batch's mean
    layout, grads = window(4, 1, seed=2)
    total = layout.items.sum()
    mean_of_means = bigbatch.form_weights("mean_of_means", layout.items, k=4)[0]
    shares = np.array(
        [
            norm(mean_of_means[m] * grads[0, m] / total) if layout.items[0, m] else 0
            for m in range(4)
        ]
    )  # the micro-batches' shares of the mean of means, |sum_r b_rm G_rm| / N
    c = float(np.sort(shares[shares > 0])[:2].mean())  # one added whole, two clipped
    with np.errstate(divide="ignore", invalid="ignore"):
        weights = mean_of_means * np.minimum(1.0, c / shares)
    report = run(layout, grads, weights[None])
    assert report.verdict == "clipped_per_micro_batch" and report.clip_base == "mean_of_means"
    assert abs(report.clipped_to - c) <= RTOL * c
    assert "before the clip, a mean_of_means" in str(report), report
    # the clipped ones are those whose share is above c, told against the mean of means'
    # weights (not the big batch's: a mean of means weighs a short micro-batch above 1)
    clipped = [m for m in range(4) if shares[m] > c]
    assert f"micro-batches {', '.join(map(str, clipped))} clipped to c" in str(report), report


def test_per_micro_batch_clipping_needs_two_micro_batches():
    # one micro-batch per device: clipping it is clipping the window
    layout, grads = window(1, 4)
    report = run(layout, grads, np.where(layout.items > 0, 0.5, np.nan))
    assert report.verdict == "exact" and "clipped_per_micro_batch" not in report.form_errors


@pytest.mark.parametrize(
    "threshold, said",
    [
        (10.0, "of norm 10.00, the max_grad_norm you passed: the whole batch clipped to it"),
        (20.0, "of norm 10.00, below the max_grad_norm you passed (20): no clip bites"),
        (5.0, "of norm 10.00, above the max_grad_norm you passed (5): it did not clip"),
    ],
)
def test_the_invariance_report_says_what_the_one_batch_run_did_with_the_threshold(threshold, said):
    one_batch = [np.array([-3.0, -4.0])]  # |delta| = 5 at lr 0.5: a gradient of norm 10
    report = bigbatch.invariance_report(
        ["k=2 x R=1"], one_batch, [one_batch], row_items=np.ones(2), learning_rate=0.5,
        max_grad_norm=threshold,
    )  # fmt: skip
    assert report.invariant and report.one_batch_norm == 10.0
    assert f"the one-batch run applied a gradient {said}" in str(report), report


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), "1", True])
def test_a_bad_threshold_is_refused_with_its_name(value):
    layout, grads = window(4, 1)
    with pytest.raises(ValueError, match="max_grad_norm: expected None, the threshold > 0"):
        run(layout, grads, np.ones(layout.items.shape), max_grad_norm=value)
