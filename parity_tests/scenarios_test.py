"""The scenario data are skewed as promised, and every layout holds exactly the global batch."""

import itertools
import math

import numpy as np
import pytest

import torch_ref
from parity_tests import scenarios
from parity_tests.scenarios import IGNORE_INDEX, Optimizer, Scenario

LAYOUTS = list(itertools.product((1, 2, 4), (1, 2, 4)))


def test_corpus_is_real_text():
    text = scenarios.corpus_bytes().decode("ascii")  # byte-level: plain ASCII prose
    lines = text.splitlines()
    assert len(lines) >= 300
    words = text.split()
    assert len(words) > 3000 and len(set(words)) > 1000  # prose, not a repeated pattern


def test_global_batches_are_skewed_and_layout_independent():
    scn = Scenario(world=2, k=2, short_window=2)
    batches = scenarios.global_batches(scn)
    assert [t.shape[0] for t, _ in batches] == [
        16,
        16,
        8,
        16,
        16,
    ]  # the short window: half the samples
    for tokens, labels in batches:
        n = scenarios.valid_tokens(labels)
        assert (n == 0).sum() >= 1  # a sample whose response was truncated away
        assert n[n > 0].min() <= 5 and n.max() >= 90  # 2-5 token samples beside ~100 token ones
        # labels are -100 on the prompt: the first label of every row is masked
        assert np.all(labels[:, 0] == IGNORE_INDEX)
        # where a label is valid it is the input token itself (the causal shift is the loss's job)
        valid = labels != IGNORE_INDEX
        assert np.array_equal(labels[valid], tokens[valid])
    # the data depend on the data seed, never on the layout
    other = scenarios.global_batches(Scenario(world=4, k=2, unit="sample", short_window=2))
    assert all(
        np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(batches, other)
    )
    assert scenarios.global_batches(scn.big_batch())[2][0].shape[0] == 8


@pytest.mark.parametrize("world,k", LAYOUTS)
@pytest.mark.parametrize("unit", scenarios.UNITS)
def test_layout_holds_the_global_batch(world, k, unit):
    scn = Scenario(world=world, k=k, unit=unit, short_window=2)
    for (tokens, labels), (lt, ll), k_u in zip(
        scenarios.global_batches(scn), scenarios.layouts(scn), scn.window_ks()
    ):
        assert lt.shape[:2] == (world, k_u)
        rows = [tuple(r) for r in lt.reshape(-1, lt.shape[-1])]
        real = [
            (tuple(t), tuple(l))
            for t, l in zip(lt.reshape(-1, lt.shape[-1]), ll.reshape(-1, ll.shape[-1]))
            if tuple(t) != (scenarios.PAD_TOKEN,) * lt.shape[-1]
        ]
        # every sample exactly once; everything else is padding with no label
        assert sorted(real) == sorted((tuple(t), tuple(l)) for t, l in zip(tokens, labels))
        assert len(rows) - len(real) == int(
            np.sum(np.all(ll == IGNORE_INDEX, -1) & np.all(lt == 0, -1))
        )
        per_micro = scenarios.units(ll, unit).sum(-1)  # [R, k_u]
        assert per_micro.sum() == scenarios.units(labels, unit).sum()  # the window count N, exactly
        if world * k_u > 1:
            assert (per_micro == 0).any()  # a micro-batch with no loss unit
        per_rank = per_micro.sum(-1)
        assert len(set(per_rank.tolist())) == world  # every rank a different count
        if world > 1 and k_u == 1:
            assert per_rank.min() == 0  # ... one of them none


def test_split_is_proportional_and_exact():
    assert scenarios._split(14, [1, 2, 3, 4]) == [
        1,
        3,
        4,
        6,
    ]  # 1.4, 2.8, 4.2, 5.6 -> largest remainders
    assert scenarios._split(5, [1.0, 1.0]) == [3, 2]
    assert sum(scenarios._split(13, [0, 1, 2, 3])) == 13


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


def test_learning_rate_is_torch_refs_warmup_cosine():
    opt = Optimizer(
        schedule="warmup_cosine", lr=1e-3, warmup=2, decay_steps=8, init_lr=1e-4, end_lr=1e-5
    )
    ref = torch_ref.WarmupCosine(warmup_steps=2, decay_steps=8, init_value=1e-4, end_value=1e-5)
    ours = [scenarios.learning_rate(opt, u) for u in range(10)]
    assert ours[0] == 1e-4 and ours[2] == 1e-3 and ours[9] == 1e-5  # by hand: init, peak, end
    # the same formula in float64, written differently: a few ulps at most
    assert max(abs(a - ref(u, 1e-3)) for u, a in enumerate(ours)) < 1e-18
    assert all(math.isfinite(x) and x > 0 for x in ours)
