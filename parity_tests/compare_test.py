"""The deviation measures on hand-made runs, and when a check passes or a control is flagged."""

import math

import numpy as np

from parity_tests import compare
from parity_tests.compare import TOLERANCES, Run


def _run(label, params, losses, counts=(10.0, 10.0), norms=(1.0, 1.0)):
    records = [
        {"loss": loss, "window_items": c, "grad_norm": g}
        for loss, c, g in zip(losses, counts, norms, strict=True)
    ]
    return Run(label, records, [{"w": np.asarray(p, np.float64)} for p in params])


def test_param_deviation_by_hand():
    # reference moves (0,0) -> (3,4) -> (6,8): ||moved|| = 5, then 10
    ref = _run("ref", [[0, 0], [3, 4], [6, 8]], [1.0, 1.0])
    sub = _run("sub", [[0, 0], [3, 4.5], [6, 9]], [1.0, 1.0])
    assert compare.param_deviation(sub, ref) == [0.5 / 5, 1.0 / 10]
    assert compare.param_deviation_elementwise(sub, ref) == [0.5 / 4, 1.0 / 8]


def test_parity_check_passes_within_tolerance_and_fails_outside():
    tol = TOLERANCES["float32"]
    ref = _run("ref", [[0.0], [1.0], [2.0]], [2.0, 1.5])
    close = _run("close", [[0.0], [1.0 + 5e-5], [2.0 + 1e-4]], [2.0 * (1 + 1e-6), 1.5])
    far = _run("far", [[0.0], [1.0 + 5e-3], [2.0]], [2.0, 1.5])
    check = compare.compare("s", close, ref, tol)
    # 5e-5 after both updates (1e-4 / 2 after update 2), up to the binary rounding of 1.00005
    assert np.allclose(check.param_dev, [5e-5, 5e-5], rtol=1e-9, atol=0) and check.passed
    assert math.isclose(check.ratios["param"], 0.5, rel_tol=1e-9)
    assert not compare.compare("s", far, ref, tol).passed
    miscounted = _run("miscounted", [[0.0], [1.0], [2.0]], [2.0, 1.5], counts=(10.0, 11.0))
    assert not compare.compare("s", miscounted, ref, tol).passed  # counts must match exactly


def test_every_counted_field_and_the_clipped_norm_must_agree():
    # fields AdamW's parameters cannot show: a count, a skip's reason, a clip's scale
    tol = TOLERANCES["float32"]
    fields = {"cumulative_items": 20.0, "update_id": 2, "skip_count": 0, "skip_reason": 0,
              "skipped": False, "grad_norm_clipped": 1.0}  # fmt: skip

    def recorded(label, **changed):
        run = _run(label, [[0.0], [1.0], [2.0]], [2.0, 1.5])
        run.records[1].update(fields, **changed)
        run.records[0].update(fields)
        return run

    ref = recorded("ref")
    assert compare.compare("s", recorded("same"), ref, tol).passed
    for changed in [{"cumulative_items": 21.0}, {"update_id": 1}, {"skip_count": 1},
                    {"skip_reason": 2}, {"skipped": True}]:  # fmt: skip
        check = compare.compare("s", recorded("off", **changed), ref, tol)
        assert check.count_dev[1] >= 1.0 and not check.passed, changed
    clipped = compare.compare("s", recorded("clip", grad_norm_clipped=0.5), ref, tol)
    assert clipped.grad_norm_dev == [0.0, 0.5] and not clipped.passed
    # a field only one run records is not compared (a big batch has no skips)
    assert compare.compare("s", _run("plain", [[0.0], [1.0], [2.0]], [2.0, 1.5]), ref, tol).passed


def test_control_is_flagged_only_at_100x_tolerance():
    tol = TOLERANCES["float32"]
    ref = _run("ref", [[0.0], [1.0], [2.0]], [2.0, 1.5])
    bug = _run(
        "bug", [[0.0], [1.0], [2.0 + 2 * 1e-4 * 100]], [2.0, 1.5]
    )  # 100 x tol after update 2
    weak = _run("weak", [[0.0], [1.0], [2.0 + 2 * 1e-4 * 10]], [2.0, 1.5])
    assert compare.compare("s", bug, ref, tol, "control").passed
    assert not compare.compare("s", weak, ref, tol, "control").passed
    diverged = _run("nan", [[0.0], [1.0], [np.nan]], [2.0, math.nan])
    assert compare.compare("s", diverged, ref, tol, "control").ratios["param"] == math.inf


def test_a_scaled_check_fails_when_both_runs_miss_the_injected_inf():
    # both sides agree (no window skipped), but window 2 was given an inf: the injection
    # was lost on both sides, and agreeing with each other is not enough
    tol = TOLERANCES["float32"]

    def scaled_run(label, skipped):
        run = _run(label, [[0.0], [1.0], [2.0]], [2.0, 1.5])
        for record, skip, update_id in zip(run.records, skipped, (1, 1), strict=True):
            record.update(skipped=skip, loss_scale=1024.0, update_id=update_id)
        return run

    missed = [scaled_run(side, [False, False]) for side in ("a", "b")]
    check = compare.compare("s", *missed, tol, scaling=True, expected_skipped=[False, True])
    assert check.sequences_equal and check.skipped_as_injected is False and not check.passed
    caught = [scaled_run(side, [False, True]) for side in ("a", "b")]
    check = compare.compare("s", *caught, tol, scaling=True, expected_skipped=[False, True])
    assert check.skipped_as_injected and check.passed


def test_a_poison_control_is_flagged_by_non_finite_parameters_only():
    # optax.MultiSteps on the loss-scaling case is also a mean of means: a finite deviation,
    # however large, is another row's bug; only parameters that stop being finite show the
    # inf kept in its state
    tol = TOLERANCES["float32"]
    ref = _run("ref", [[0.0], [1.0], [2.0]], [2.0, 1.5])
    far = _run("far", [[0.0], [1.0], [2.0 + 1.0]], [2.0, 1.5])
    poisoned = _run("poisoned", [[0.0], [1.0], [np.nan]], [2.0, math.nan])
    assert compare.compare("s", far, ref, tol, "control").passed  # 1e4 x tolerance
    assert not compare.compare("s", far, ref, tol, "poison-control").passed
    assert compare.compare("s", poisoned, ref, tol, "poison-control").passed
