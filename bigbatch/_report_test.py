"""The report reads at a glance: the headline, the table, and ``assert report.passed, report``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import bigbatch
from bigbatch._fit_test import audit_of


def report_of(weights: np.ndarray, items: np.ndarray, k: int) -> bigbatch.AuditReport:
    """The report of a loop that weighs each cell by ``weights`` (units of 1/N), exactly."""
    layout = bigbatch.CellLayout(
        rows=np.arange(items.size).reshape(items.shape + (1,)), items=items, k=k,
        left_out=np.zeros(0, np.int64),
    )  # fmt: skip
    grads = np.random.default_rng(0).normal(size=items.shape + (4 * items.size,))
    grads[items == 0] = 0.0
    gradient = np.einsum("rm,rmp->p", np.nan_to_num(weights), grads) / items.sum()
    return audit_of(-gradient, grads, layout, 1.0)


ITEMS = np.array([[3.0, 5.0, 2.0, 7.0], [4.0, 1.0, 6.0, 9.0]])


def test_the_headline_names_the_worst_cell():
    weights = np.ones_like(ITEMS)
    weights[1, 3] = 12.3  # one cell over-weighted, the rest like the big batch
    report = report_of(weights, ITEMS, k=4)
    expected = "your loop weighs an item of device 1, micro-batch 3 at 12.3x the big batch"
    assert report.summary() == f"FAILED, unknown: {expected}"
    assert expected in str(report) and expected in repr(report)


def test_a_device_whose_cells_weigh_alike_is_named_as_a_device():
    weights = bigbatch.form_weights("local_denominator", ITEMS, k=4)
    report = report_of(weights, ITEMS, k=4)
    # N = 37, N_0 = 17, N_1 = 20: 37 / 34 = 1.09 and 37 / 40 = 0.925
    assert "an item of device 0 at 1.09x the big batch, one of device 1 at 0.925x" in repr(report)


def test_a_known_form_off_by_one_factor_is_named_with_the_factor():
    # a mean per micro-batch over all devices, never divided by k: 4 x mean_of_global_means,
    # a form of its own nowhere; the note names the form it is a multiple of, and the factor
    weights = 4.0 * bigbatch.form_weights("mean_of_global_means", ITEMS, k=4)
    report = report_of(weights, ITEMS, k=4)
    assert report.verdict == "unknown"
    assert "verdict: unknown: mean_of_global_means's weights times 4: a divisor" in str(report)
    # gradients summed over the 2 devices twice: every item at 2x, the big batch's times 2
    report = report_of(2.0 * np.ones_like(ITEMS), ITEMS, k=4)
    assert report.summary() == "FAILED, unknown: your loop weighs every item at 2.00x the big batch"
    assert (
        "verdict: unknown: the big batch's weights times 2: that factor is the number of"
        " devices, 2: the gradient summed over them twice (an all-reduce on top of one"
        " already made" in str(report)
    )
    assert "clip" not in str(report).split("verdict: ")[1].split("\n")[0]  # 2x: no clip does it
    # a zero_grad inside the window: only the last micro-batch reaches the update
    weights = np.zeros_like(ITEMS)
    weights[:, 3] = ITEMS.sum() / ITEMS[:, 3].sum()
    assert (
        "verdict: unknown: micro-batches 0, 1, 2 on every device weighed 0: a gradient that"
        " never reached the update" in str(report_of(weights, ITEMS, k=4))
    )
    # one device's gradient never all-reduced: the device is named, and the missing sync
    weights = np.zeros_like(ITEMS)
    weights[0] = 2.0
    assert (
        "verdict: unknown: device 1 weighed 0: a gradient that never reached the update (a"
        " device's gradient left out of the all-reduce" in str(report_of(weights, ITEMS, k=4))
    )
    # no form times any factor: the closest form and how far it is
    weights = np.ones_like(ITEMS)
    weights[1, 3] = 12.3
    assert "a reweighting, but of no known form (closest: " in str(report_of(weights, ITEMS, k=4))


def test_a_clip_reading_names_the_form_a_factor_above_one_would_give():
    # a mean per micro-batch and device, psum-ed over the 2 devices where a pmean belongs:
    # mean_of_means times 2, the same weights as missing_1_over_k clipped to half; without a
    # threshold the audit reads the clip first, and says the other reading
    weights = 2.0 * bigbatch.form_weights("mean_of_means", ITEMS, k=4)
    report = report_of(weights, ITEMS, k=4)
    assert report.verdict == "missing_1_over_k" and report.clipped_once
    assert (
        "the same weights are mean_of_means's times 2: no clip then, but that factor is the"
        " number of devices, 2" in str(report)
    )


def test_a_short_window_divided_by_the_nominal_k_is_named():
    # a short window of 2 micro-batches (k = 4): means averaged over len(microbatches) are
    # the mean of means; nanoGPT's constant k weighs k_tail / k = 1/2 of that (math.md 6)
    items = ITEMS[:, :2]
    mean_of_means = bigbatch.form_weights("mean_of_means", items, k=4)
    assert report_of(mean_of_means, items, k=4).verdict == "mean_of_means"
    report = report_of(0.5 * mean_of_means, items, k=4)
    tail = "that factor is k_tail / k = 2 / 4: the short window divided by the nominal k"
    assert report.verdict == "mean_of_means" and report.clipped_once  # no threshold given
    assert f"every item weighed 0.5x ({tail}" in str(report)
    # the same factor in a full window is no such division: the general causes only
    report = report_of(0.5 * bigbatch.form_weights("mean_of_means", ITEMS, k=4), ITEMS, k=4)
    assert "k_tail / k" not in str(report)


def test_a_residual_names_other_loss_units_and_the_device_count():
    # one device: the big batch's gradient plus random noise, which no reweighting explains
    noise = np.random.default_rng(1).normal(size=4 * ITEMS.size)
    layout = bigbatch.CellLayout(
        rows=np.arange(4).reshape(1, 4, 1), items=ITEMS[:1], k=4, left_out=np.zeros(0, np.int64)
    )
    grads = np.random.default_rng(0).normal(size=(1, 4, 4 * ITEMS.size))
    gradient = grads.sum(axis=(0, 1)) / ITEMS[:1].sum() + 0.1 * noise
    report = audit_of(-gradient, grads, layout, 1.0)
    note = str(report).split("verdict: unknown: ")[1]
    assert note.startswith("a loss in other units than the reference (a mean per sequence")
    assert "a loop over several devices audited as one (give the audit their count" in note


def test_the_table_has_a_row_per_cell_and_the_notes():
    items = np.array([[3.0, 5.0, 2.0, 7.0], [0.0, 1.0, 6.0, 20.0]])  # a cell without items
    report = report_of(bigbatch.form_weights("mean_of_means", items, k=4), items, k=4)
    lines = str(report).splitlines()
    assert lines[0].startswith("Audit of one accumulated SGD update (4 micro-batches x 2 devices")
    header = lines[2].split()
    assert (
        header[:4] == ["device", "micro-batch", "items", "your"] and header[-1] == "mean_of_means"
    )
    rows = [line.split() for line in lines[3:11]]
    assert [row[:2] for row in rows] == [[str(r), str(m)] for r in range(2) for m in range(4)]
    # device 0, micro-batch 0: 3 of 44 items; the mean of means weighs them 44 / (4 * 2 * 3)
    assert rows[0][2:] == ["3", "1.83x", "1.00x", "1.83x"]
    assert rows[4][3] == "-" and "left out of the fit" in lines[7]
    assert any(line.startswith("fix: accumulate summed losses") for line in lines)
    markdown = report.to_markdown().splitlines()
    assert markdown[2].startswith("| device | micro-batch | items | your weight | big batch |")
    assert markdown[3].startswith("|---:|---:|") and len(markdown[4:12]) == 8


def test_the_repr_fits_what_pytest_shows_of_an_assertion_message():
    many = np.arange(1.0, 65.0).reshape(8, 8)  # 8 devices x 8 micro-batches
    report = report_of(bigbatch.form_weights("mean_of_means", many, k=8), many, k=8)
    assert len(repr(report)) <= 240, repr(report)  # pytest's limit without -vv


@pytest.mark.slow  # subprocess pytest run (> 1 s): make test, not test-fast
def test_assert_report_passed_reads_well_in_a_users_pytest(tmp_path):
    # a user's test file, no conftest: pytest prints the repr of the message
    test_file = tmp_path / "test_my_loop.py"
    test_file.write_text(
        textwrap.dedent("""
        import numpy as np
        import bigbatch

        def test_my_loop():
            layout = bigbatch.layout_rows(np.array([3.0, 1.0]), k=2, num_devices=1)
            grads = [np.array([1.0, 0.0]), np.array([0.0, 3.0])]
            products = bigbatch.cell_products(
                lambda r, m: [grads[m]], [np.array([-0.5, -0.5])], layout, learning_rate=1.0)
            report = bigbatch.audit_update(products, layout, learning_rate=1.0)
            assert report.passed, report
    """)
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    expected = (
        "AssertionError: AuditReport(FAILED, mean_of_means: your loop weighs an item of"
        " micro-batch 0 at 2.00x the big batch, one of micro-batch 1 at 0.667x;"
        " print(report) for the table)"
    )
    assert expected in result.stdout, result.stdout


@pytest.mark.parametrize(
    "empty, unchecked",
    [((slice(None), 0), ["micro-batch 0"]), ((1, slice(None)), ["device 1"])],
    ids=["micro-batch", "device"],
)
def test_an_exact_window_with_a_whole_micro_batch_or_device_empty_is_not_confirmed(
    empty, unchecked
):
    # a loop that drops micro-batch 0 (its accumulator overwritten) or device 1 (an
    # all-reduce forgotten) weighs the items it sees like the big batch: it used to pass
    items = ITEMS.copy()
    items[empty] = 0.0
    report = report_of(np.where(items > 0, 1.0, np.nan), items, k=4)
    assert report.verdict == "exact" and report.unchecked == unchecked
    assert not report.passed and report.unconfirmed
    assert report.summary().startswith("NOT CONFIRMED, exact") and unchecked[0] in report.summary()
    # one empty cell alone leaves its micro-batch and its device checked elsewhere
    items = ITEMS.copy()
    items[0, 0] = 0.0
    report = report_of(np.where(items > 0, 1.0, np.nan), items, k=4)
    assert report.passed and report.unchecked == []
