"""The invariance audit: the same rows cut several ways give one update, or the cut shows.

The loops run one SGD update of the audit tests' tiny GPT on 16 rows (4 without a
token, so one rank of a 2-rank cut gets none). Three objectives: torch_ref's
reference (the token mean of the window), a sequence mean taken over the whole
window (GRPO's, invariant without being the token mean), and nanoGPT's per
micro-batch token mean / k (a mean of means: the cut shows).
"""

from __future__ import annotations

import numpy as np
import pytest

import bigbatch
from torch_ref import train_update
from torch_ref._audit_test import MODEL, SKEWED, loss_fn, nanogpt_window
from torch_ref.audit import audit_invariance

pytestmark = pytest.mark.slow  # each audit runs the loop twice per cut, 2-rank cuts on gloo ranks

# An invariant float32 update differs from the one-batch update by rounding (measured
# 2e-7 to 6e-7 here); bigbatch.INVARIANCE_RTOL = 1e-5 is the verdict's bound.
# The rows' weights of a float32 loop come out within ~1e-6 of their formula (the
# fitted ratio of two float32 fits); 1e-4 leaves 100x room.
WEIGHT_RTOL = 1e-4
CUTS = ((2, 1), (4, 1), (2, 2), (4, 2))


def reference_window(model, optimizer, microbatches):
    """torch_ref's loop: the token mean of the whole window, whatever the cut."""
    train_update(model, microbatches, optimizer, empty_window="skip")


def sequence_mean_window(model, optimizer, microbatches):
    """Each row's token mean, averaged over the window's rows (the cells hold equal rows:
    ``rows per micro-batch * k``, and DDP's mean over the ranks): GRPO's objective."""
    window_rows = sum(len(mb["labels"]) for mb in microbatches)
    for mb in microbatches:
        rows = [
            {name: value[i : i + 1] for name, value in mb.items()} for i in range(len(mb["labels"]))
        ]
        sums = [loss_fn(model, row) for row in rows]
        means = [loss_sum / n for loss_sum, n in sums if n > 0]
        # every rank runs a backward per micro-batch (DDP all-reduces in it), items or not
        zero = 0.0 * model(mb["input_ids"]).sum()
        ((sum(means) + zero) / window_rows).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def audit(window_fn, **kwargs) -> bigbatch.InvarianceReport:
    return audit_invariance(window_fn, MODEL, SKEWED, cuts=CUTS, loss_fn=loss_fn, **kwargs)


def test_the_reference_loop_is_invariant_and_weighs_every_row_alike():
    report = audit(reference_window)
    assert report.invariant and report.breaking is None, report
    np.testing.assert_allclose(np.nanmax(np.abs(report.weights - 1)), 0, atol=WEIGHT_RTOL)
    assert "INVARIANT" in str(report) and "k=4 x R=2" in str(report)


def test_a_sequence_mean_over_the_window_is_invariant_too():
    # not the token mean (the token audit would call it unknown), but the same for every cut
    report = audit(sequence_mean_window)
    assert report.invariant, report


def test_nanogpt_depends_on_the_cut_by_its_mean_of_means_weights():
    report = audit(nanogpt_window)
    assert not report.invariant and report.worst > 100 * report.tolerance, report
    items = report.row_items
    for i, (k, ranks) in enumerate(CUTS):
        layout = bigbatch.layout_rows(items, k=k, num_devices=ranks)
        # one batch: every token 1/N; the cut: 1/(k R n_c) for a token of cell c
        expected = np.full(items.size, np.nan)
        cell_weights = bigbatch.form_weights("mean_of_means", layout.items, k=k)
        for r in range(ranks):
            for m in range(k):
                expected[layout.rows[r, m]] = cell_weights[r, m]
        expected[items == 0] = np.nan
        np.testing.assert_allclose(report.weights[i], expected, rtol=WEIGHT_RTOL)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cuts=((3, 1),)), "cuts: the cut k=3 x R=1 needs a multiple of 3 rows"),
        (dict(cuts=((0, 1),)), r"cuts: expected a non-empty list of \(k, R\) pairs"),
        (dict(cuts=()), r"cuts: expected a non-empty list"),
        (dict(loss_fn=None, row_items=[1.0] * 3), "row_items: expected 16 finite"),
    ],
)
def test_bad_arguments_are_refused_with_their_name(kwargs, match):
    arguments = dict(cuts=CUTS, loss_fn=loss_fn) | kwargs
    with pytest.raises(ValueError, match=match):
        audit_invariance(reference_window, MODEL, SKEWED, **arguments)
