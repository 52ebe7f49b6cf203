"""A scenario's windows: the same samples for every layout, each window exactly its batch.

The data and the layout rules are ``tinygpt.data``'s (tested in ``tinygpt/data_test.py``);
here, what the suite adds: the short window, one ``mb`` per scenario, the names.
Every number is an integer count: compared exactly.
"""

import itertools

import numpy as np
import pytest

from parity_tests import cases, scenarios
from parity_tests.scenarios import Scenario
from tinygpt import data

LAYOUTS = list(itertools.product((1, 2, 4), (1, 2, 4)))


def test_global_batches_are_layout_independent_and_the_short_window_half():
    scn = Scenario(world=2, k=2, short_window=2)
    batches = scenarios.global_batches(scn)
    assert [t.shape[0] for t, _ in batches] == [16, 16, 8, 16, 16]  # the short window: half
    for _, labels in batches:
        n = data.valid_tokens(labels)
        assert (n == 0).sum() >= 1 and n[n > 0].min() <= 5 and n.max() >= 90  # skewed
    # the data depend on the data seed, never on the layout
    other = scenarios.global_batches(Scenario(world=4, k=2, unit="sample", short_window=2))
    assert all(
        np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
        for a, b in zip(batches, other, strict=True)
    )
    assert scenarios.global_batches(scn.big_batch())[2][0].shape[0] == 8


@pytest.mark.parametrize("world,k", LAYOUTS)
def test_layouts_hold_each_window_with_one_micro_batch_size(world, k):
    scn = Scenario(world=world, k=k, short_window=2)
    laid = scenarios.layouts(scn)
    assert len({tok.shape[2] for tok, _ in laid}) == 1  # one mb: one compilation
    for (tokens, labels), (tok, lab), k_u in zip(
        scenarios.global_batches(scn), laid, scn.window_ks(), strict=True
    ):
        assert tok.shape[:2] == (world, k_u)  # the short window: 1 micro-batch per rank
        assert data.valid_tokens(lab).sum() == data.valid_tokens(labels).sum()  # N, exactly
        assert (tok != data.PAD_TOKEN).any(-1).sum() == len(tokens)  # every sample once


def test_short_names_are_unique_over_the_full_matrix():
    scns, controls = cases.matrix("cpu", quick=False)
    names = {s.short_name for s in scns + controls}
    assert len(names) == len(set(scns + controls)) == 37  # 36 layouts/units/dtypes + scaling
    assert cases.scaling_scenario().short_name == "R2k2-token-f32-fp16scale"


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(unit="tokens"), "unit"),
        (dict(dtype="float16"), "dtype"),
        (dict(world=0), "world"),
        (dict(k=2, k_short=3), "k_short"),
        (dict(k=2, short_window=7), "short_window"),
    ],
)
def test_scenario_rejects_bad_settings(bad, match):
    with pytest.raises(ValueError, match=match):
        Scenario(**bad)
