"""The quick parity suite (the same as ``python -m parity_tests --quick``), asserted.

One module-scoped run of :func:`parity_tests.suite.run_suite` (CPU, quick: R2k2
token fp32 with every negative control, R4k1 sample fp32, R2k2 token fp64, and
R2k2 token with fp16 dynamic loss scaling and an injected overflow, with the
controls that only an overflow shows), then one test per promise. Tolerances and
their reasons live in ``parity_tests.compare.TOLERANCES`` (fp32: parameters 1e-4 of the movement,
fp64: 1e-9, each with the measured worst it leaves room over).

The suite runs under the session's strict promotion (``conftest.py``): its own
code and jaxaccum are checked; optax's calls are wrapped at the call
(``testkit.standard``, in ``parity_tests.jax_optim``).
"""

import json
import math

import pytest

pytest.importorskip("torch", reason="needs torch: no CPU build for this Python here")

import torch_ref  # noqa: E402
from parity_tests import cases, compare, report, report_files, suite  # noqa: E402
from parity_tests.checks import FLAG_RATIO  # noqa: E402
from parity_tests.compare import TOLERANCES  # noqa: E402
from parity_tests.torch_scenario import WarmupCosine  # noqa: E402

pytestmark = pytest.mark.slow  # processes, or minutes of compiling: `make test` only


@pytest.fixture(scope="module")  # `make test` hands a whole file to one worker (loadfile)
def result():
    return suite.run_suite("cpu", quick=True, progress=False)


def _checks(result, subject, reference, dtype=None):
    found = [
        c
        for c in result.checks
        if c.subject == subject
        and c.reference == reference
        and (dtype is None or f"-{dtype}-" in c.scenario)
    ]
    assert found, f"no check {subject} vs {reference} ({dtype}); errors: {list(result.errors)}"
    return found


def _describe(c):
    r = c.row()
    return (
        f"{c.scenario}: {c.subject} vs {c.reference}: param {r['param_dev']:.3g} (tol {c.tol.param:g}), "
        f"loss {r['loss_dev']:.3g} (tol {c.tol.loss:g}), grad norm {r['grad_norm_dev']:.3g} "
        f"(tol {c.tol.grad_norm:g}), count {r['count_dev']}"
    )


def _assert_within(checks):
    bad = [_describe(c) for c in checks if not c.passed]
    assert not bad, "\n".join(bad)
    for c in checks:
        r = c.row()
        assert r["param_dev"] <= c.tol.param and r["loss_dev"] <= c.tol.loss
        assert r["grad_norm_dev"] <= c.tol.grad_norm
        assert r["count_dev"] == 0.0  # window counts are integers: exactly equal


def test_every_run_completed(result):
    assert not result.errors, "\n\n".join(f"{k}:\n{v}" for k, v in result.errors.items())


def test_jaxaccum_matches_torch_ref_fp32(result):
    # fp32 tolerance (compare.TOLERANCES): parameters within 1e-4 of how far they moved after
    # each of 5 AdamW updates; loss within 2e-6 and grad norm within 5e-6, relative.
    checks = _checks(result, "jaxaccum", "torch_ref", "float32")
    assert {c.scenario.split("-")[1] for c in checks} == {"token", "sample"}
    _assert_within(checks)
    # and count_dev covers every counted field, grad_norm_dev the clipped norm: both record them
    for label in ("jaxaccum", "torch_ref"):
        runs = [run for run in result.runs.values() if run.label == label]
        assert runs and all(
            {*compare.COUNTED, "grad_norm_clipped"} <= set(r) for run in runs for r in run.records
        ), label


def test_every_layout_is_the_big_batch_in_each_framework(result):
    _assert_within(
        _checks(result, "jaxaccum", "jax big batch", "float32")
        + _checks(result, "torch_ref", "torch big batch", "float32")
        + _checks(result, "jax big batch", "torch big batch", "float32")
    )


def test_float64_parity(result):
    # fp64 tolerance: parameters within 1e-9 of their movement (unit roundoff 1.1e-16; the
    # measured deviation of the two big batches without clipping is ~5e-14).
    checks = [c for c in result.checks if "-float64-" in c.scenario and c.kind == "parity"]
    subjects = {(c.subject, c.reference) for c in checks}
    assert ("jaxaccum", "torch_ref") in subjects, (
        f"jaxaccum fp64 did not run: {list(result.errors)}"
    )
    assert all(c.tol.param == 1e-9 for c in checks)
    _assert_within(checks)


def test_fp16_loss_scaling_parity(result):
    # fp16 dynamic loss scaling (fp32 compute), an inf injected into rank 1's first micro-batch
    # of window 3 on both sides: the same windows skipped, the same loss-scale sequence
    # (powers of two: exact), the same update ids, and parameters within the fp32 tolerance.
    scn = cases.scaling_scenario()
    (check,) = [c for c in result.checks if c.scenario == scn.name and c.kind == "parity"]
    assert (check.subject, check.reference) == ("jaxaccum", "torch_ref")
    seq = check.sequences
    assert seq["skipped"] == ([False, False, False, True, False],) * 2
    # init 2**10; growth_interval 2: doubled after windows 0-1, halved by the overflow.
    assert seq["loss_scale"] == ([1024.0, 2048.0, 2048.0, 1024.0, 1024.0],) * 2
    assert seq["update_id"] == ([1, 2, 3, 3, 4],) * 2
    assert check.sequences_equal and check.skipped_as_injected
    _assert_within([check])
    # The skipped window leaves the parameters unchanged on both sides.
    for run in (result.runs[suite._key("jaxaccum", scn)], result.runs[suite._key("torch", scn)]):
        assert all((run.params[4][n] == run.params[3][n]).all() for n in run.params[3])
    row = check.row()
    assert row["sequences_equal"] is True and row["sequences"]["loss_scale"]["subject"][1] == 2048.0
    assert any("sequences equal" in r[1] for r in report_files.rows(result))


def test_negative_controls_are_flagged(result):
    controls = [c for c in result.checks if c.kind in ("control", "poison-control")]
    expected = {"optax.MultiSteps", "optax.MultiSteps (no skip)"} | {
        f"torch_ref:{b}" for b, v in torch_ref.buggy.VARIANTS.items() if not v.communication_only
    }
    assert {c.subject for c in controls} == expected
    # without a skip, the inf of window 3 reaches optax.MultiSteps' state: NaN from then on
    (poisoned,) = [c for c in controls if c.subject == "optax.MultiSteps (no skip)"]
    assert poisoned.reference == "jaxaccum" and poisoned.ratios["param"] == math.inf
    weak = [
        f"{_describe(c)}; ratios {c.ratios}" for c in controls if c.ratios["param"] < FLAG_RATIO
    ]
    # Every numeric bug moves the parameters >= 100 x the fp32 tolerance away from the big
    # batch on the default skewed data (measured: 309 for ddp_average_forgotten up to ~1e5),
    # or from torch_ref on the loss-scaling scenario (measured 669 and 4760, the test below).
    assert not weak, "\n".join(weak)
    assert all(c.tol == TOLERANCES["float32"] and c.passed for c in controls)


def test_the_bugs_of_a_skipped_window_are_flagged_by_their_parameters(result):
    # They change nothing until window 3 overflows, so they run on the loss-scaling scenario
    # only, each against torch_ref there (no big batch skips a window); fp32's tolerance.
    scn, tol = cases.scaling_scenario(), TOLERANCES["float32"].param
    ref = result.runs[suite._key("torch", scn)]
    found = {c.subject: c for c in result.checks if c.scenario == scn.name and c.kind != "parity"}
    assert set(found) == {"optax.MultiSteps (no skip)", "torch_ref:skip_per_microbatch",
                          "torch_ref:scheduler_per_window"}  # fmt: skip
    skip, sched = found["torch_ref:skip_per_microbatch"], found["torch_ref:scheduler_per_window"]
    assert skip.reference == sched.reference == "torch_ref" and skip.kind == sched.kind == "control"
    assert skip.passed and sched.passed
    # skip_per_microbatch: the same updates before the overflow (each micro-batch all-reduces:
    # fp32 rounding, measured <= 3.6e-6), then window 3 applied without the inf's micro-batch:
    # 0.48 of the movement (measured), 4.8e3 x the tolerance.
    assert max(skip.param_dev[:3]) <= tol and skip.param_dev[3] >= FLAG_RATIO * tol
    run = result.runs[suite._key("torch", scn, "skip_per_microbatch")]
    # nothing is skipped, and the scale grows where torch_ref's backs off (powers of 2: exact)
    assert [r["skipped"] for r in run.records] == [False] * 5
    assert [r["loss_scale"] for r in run.records] == [1024.0, 2048.0, 2048.0, 4096.0, 4096.0]
    # scheduler_per_window: bitwise torch_ref until the schedule moved on window 3, then window 4
    # runs at update 4's LR, not update 3's: 0.067 of the movement (measured), 6.7e2 x the
    # tolerance. Its skipped, loss_scale and update_id sequences are torch_ref's, exactly.
    assert sched.param_dev[:4] == [0.0] * 4 and sched.param_dev[4] >= FLAG_RATIO * tol
    run = result.runs[suite._key("torch", scn, "scheduler_per_window")]
    assert all(a == b for a, b in compare.sequences(run, ref).values())
    o = scn.opt
    lr = WarmupCosine(o.warmup, o.decay_steps, o.init_lr, o.end_lr)
    # LambdaLR's peak * (lr / peak): float64 rounding
    assert run.records[4]["learning_rate"] == pytest.approx(lr(4, o.lr), rel=1e-12)
    assert ref.records[4]["learning_rate"] == pytest.approx(lr(3, o.lr), rel=1e-12)


def test_no_sync_around_backward_only_costs_an_allreduce_per_micro_batch(result):
    (check,) = [c for c in result.checks if c.kind == "comm-control"]
    # Same gradient by design (parameters within the fp32 tolerance) ...
    assert max(check.param_dev) <= TOLERANCES["float32"].param
    # ... but every micro-batch all-reduces: 4 windows of k=2 and the short one of 1 -> 9/5 per
    # window, against exactly 1 for torch_ref (an exact count, no tolerance).
    assert check.comm == (1.8, 1.0)
    assert check.passed


def test_the_jax_runs_take_the_data_parallel_path(result):
    # plain jit on an Explicit mesh of R of the 8 fake devices; loss scaling as vmap lanes
    # (jaxaccum.value_and_grad's loss_scale under Explicit jit: see run_jax._jaxaccum_loop)
    strategies = {
        k.split("|")[1]: r.extra["strategy"]
        for k, r in result.runs.items()
        if k.startswith("jaxaccum|")
    }
    assert strategies == {
        cases.control_scenario().name: "jit",
        cases.scenario(4, 1, "sample").name: "jit",
        cases.scenario(2, 2, "token", "float64").name: "jit",
        cases.scaling_scenario().name: "vmap",
    }


def test_report_files(result, tmp_path):
    paths = report_files.write(result, tmp_path, report.render(result))
    data = json.loads(paths["json"].read_text())
    assert len(data["checks"]) == len(result.checks) and data["passed"] == result.passed
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["md"].read_text()
    assert md.count("\n| R") == len(result.checks)  # one table row per check
    assert (
        "loss_scale: jaxaccum [1024 2048 2048 1024 1024], torch_ref [1024 2048 2048 1024 1024]"
        in md
    )
    assert any(c["sequences_equal"] for c in data["checks"])
    # finite, but for the control whose state an inf poisoned
    finite = [math.isfinite(c.row()["param_dev"]) for c in result.checks]
    assert finite == [c.kind != "poison-control" for c in result.checks]


def test_printed_report_reads_in_100_columns(result):
    parity = [c for c in result.checks if c.kind == "parity"]
    bugs = [c for c in result.checks if c.kind != "parity"]
    # the verdict first: every count exact
    assert report.verdict(result).startswith(
        f"PASS: {len(parity)}/{len(parity)} checks within tolerance, "
        f"{len(bugs)}/{len(bugs)} known bugs flagged ("
    )
    assert (len(parity), len(bugs)) == (12, 12)
    table = report.table(result).splitlines()
    lines = [report.verdict(result), *report.legend(result), *table]
    lines += report.comm_lines(result) + report.scaling_lines(result, short=True)
    assert max(len(line) for line in lines) <= report.WIDTH  # 100 columns
    # one line per check, one per scenario, a "known bugs" line per scenario with controls
    # (the control scenario, the loss-scaling one), the header and its rule
    scenarios = {c.scenario for c in result.checks}
    assert len(table) == len(result.checks) + len(scenarios) + 2 + 2
    assert any(line.startswith("R2k2-token-f32-fp16scale") for line in table)
    assert "R<ranks>k<micro-batches per rank>" in " ".join(report.legend(result))


def test_cli_fails_clearly_without_gpu(tmp_path, monkeypatch, capsys):
    from parity_tests import __main__ as cli

    problem = cli._check_cuda()
    if problem is None:
        pytest.skip("a GPU is visible to JAX and torch: the CUDA path runs instead of failing")
    assert "torch.cuda.is_available() is False" in problem or "JAX sees no GPU" in problem
    # JAX is already configured in this process (conftest): skip the CLI's own configuration.
    monkeypatch.setattr(cli, "_configure_jax", lambda device: None)
    assert cli.main(["--device", "cuda", "--out", str(tmp_path)]) == 2  # 2: device not available
    assert "--device cuda needs a GPU visible to both JAX and torch" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing ran, nothing written
