"""The printed report and the plot on hand-made checks (no run of the suite)."""

import math

import numpy as np

from parity_tests import cases, plot, report, report_files
from parity_tests.compare import TOLERANCES, Run, SuiteResult, compare

SCN = cases.control_scenario()


def _run(label, moves, losses):
    """Two parameters, one update per entry of ``moves`` (a reference moves by 1.0)."""
    params = [{"w": np.zeros(2)}] + [{"w": np.asarray([1.0, m])} for m in moves]
    records = [{"loss": x, "window_items": 10.0, "grad_norm": 1.0} for x in losses]
    return Run(label, records, params)


def _result() -> SuiteResult:
    ref = _run("torch big batch", [0.0, 0.0, 0.0], [2.0, 1.5, 1.2])
    close = _run("jaxaccum", [5e-5, 0.0, 0.0], [2.0, 1.5, 1.2 * (1 + 1e-6)])
    bug = _run("torch_ref:mean_of_means", [0.0, 0.0, 1.0], [2.0, 1.5, 1.2])
    tol = TOLERANCES["float32"]
    checks = [compare(SCN.name, close, ref, tol), compare(SCN.name, bug, ref, tol, "control")]
    runs = {"jaxaccum|x": close, "torch big|x": ref, "torch|x|bug": bug}
    return SuiteResult("cpu", True, checks, runs, {}, 12.0, {SCN.name: SCN})


def test_update_ratios_are_the_worst_measure_over_its_tolerance():
    parity, control = _result().checks
    # update 1: param 5e-5 / 1.0 moved = 0.5 of 1e-4; update 3: loss 1e-6 = 0.5 of 2e-6
    assert np.allclose(plot.update_ratios(parity), [0.5, 0.0, 0.5], rtol=1e-9, atol=1e-12)
    # update 3: the bug is 1 away from a reference that moved by 1: 1 / 1e-4 (exact in float64)
    assert math.isclose(plot.update_ratios(control)[2], 1.0 / 1e-4, rel_tol=1e-12)


def test_printed_report_verdict_first_and_narrow(tmp_path):
    result = _result()
    assert report.verdict(result) == (
        "PASS: 1/1 checks within tolerance, 1/1 known bugs flagged (12 s)"
    )
    table = report.table(result).splitlines()
    assert table[2] == "R2k2-token-f32"  # the scenario id, then its rows
    assert table[3].split()[:3] == ["jaxaccum", "vs", "torch"] and table[3].endswith("pass")
    assert table[-1].split()[0] == "torch_ref:mean_of_means" and table[-1].endswith("flagged")
    assert max(len(line) for line in report.legend(result) + table) <= report.WIDTH
    paths = report_files.write(result, tmp_path, report.render(result))
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "**PASS**: 1/1 checks within tolerance" in paths["md"].read_text()
