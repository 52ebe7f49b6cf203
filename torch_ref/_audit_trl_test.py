"""`audit_trl_grpo` on TRL 1.16's GRPOTrainer: each kind of verdict, the weights from TRL's code.

Every audit runs GRPOTrainer twice (the cut, and one batch of the same rows) for one SGD
update of a tiny GPT-2 (`torch_ref._audit_trl`). The formulas are those of
``parity_tests.trl_prediction`` (``token_weights``: TRL's ``_compute_loss`` line by line), which
``make trl-audit`` checks for every loss type and cut; here one cut of each kind of verdict.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from parity_tests import trl_prediction
from torch_ref._audit_trl_cut import check_cut
from torch_ref.audit import GRPOCut, audit_trl_grpo, audit_trl_grpo_cuts

# An invariant cut: float32 gradients added in another order, the update read back as
# new - old: measured 2e-7 to 4e-7 from the one-batch update (bigbatch.INVARIANCE_RTOL: 1e-5).
INVARIANT_MAX = 1e-5
# A cut-dependent normalization moves these rows' update by 9% (dapo, spg = 2 GA, 2 ranks)
# to 50% (bnpo, GA = 4): 1e-2 is 10x below the smallest, 1000x above rounding.
BROKEN_MIN = 1e-2
# A fitted weight against its formula: measured within 2e-6 (float32, the fit's condition).
WEIGHT_RTOL = trl_prediction.WEIGHT_RTOL


def assert_weights(report) -> np.ndarray:
    """The fitted weights are the formula's (relative to one batch); returns the formula's."""
    relative, _ = trl_prediction.predicted(report)
    np.testing.assert_allclose(report.weights[0], relative, rtol=WEIGHT_RTOL)
    assert np.max(report.residuals) <= trl_prediction.RESIDUAL_MAX, report  # a reweighting
    assert not trl_prediction.check(report), trl_prediction.check(report)
    return relative


@pytest.fixture
def trl():
    """The optional extra .[trl] (trl, datasets), or a skip."""
    pytest.importorskip("datasets")
    return pytest.importorskip("trl")


slow = pytest.mark.slow  # GRPOTrainer runs (and 2 gloo ranks): make test only


@slow
def test_dapo_with_one_generation_per_update_is_the_token_big_batch(trl):
    # dapo divides by num_items_in_batch: the generation batch's tokens gathered over ranks,
    # x GA / spg (grpo_trainer.py:3168-3174): with spg = GA, the window's N, once
    report = audit_trl_grpo("dapo", gradient_accumulation_steps=4, progress=False)
    assert report.invariant and report.worst <= INVARIANT_MAX, report
    assert np.all(report.big_batch_differences <= INVARIANT_MAX), report  # 1/N, every token
    np.testing.assert_array_equal(assert_weights(report), 1.0)
    assert report.generation_tokens == report.window_tokens == 73


@slow
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "luspo"])
def test_sequence_and_constant_normalizations_are_invariant_with_their_own_objective(
    trl, loss_type
):
    # per-sequence token mean (grpo), a constant B L (dr_grpo), per-sequence sum (luspo), each
    # mean over the B rows / GA, DDP / R: the same for every cut, but not the token mean
    report = audit_trl_grpo(loss_type, gradient_accumulation_steps=4, progress=False)
    assert report.invariant and report.worst <= INVARIANT_MAX, report
    np.testing.assert_array_equal(assert_weights(report), 1.0)
    assert np.all(report.big_batch_differences >= BROKEN_MIN), report  # its own big batch


@slow
def test_bnpo_takes_a_mean_of_micro_batch_means(trl):
    # bnpo: each micro-batch's token sum over ITS tokens, / GA (grpo_trainer.py:3158-3162);
    # TRL: "normalization is performed over the local batch only"
    report = audit_trl_grpo("bnpo", gradient_accumulation_steps=4, progress=False)
    assert not report.invariant and report.worst >= BROKEN_MIN, report
    weights = assert_weights(report)  # N / (GA T_mb): 73 / (4 T_mb)
    micro_tokens = np.array([8, 14, 26, 25])  # one prompt group per micro-batch
    np.testing.assert_allclose(np.unique(weights), np.sort(73 / (4 * micro_tokens)), rtol=1e-12)


@slow
def test_dapo_with_two_updates_per_generation_depends_on_the_next_update(trl):
    # spg = 2 GA: num_items_in_batch counts BOTH updates' tokens, x GA / spg = 1/2: each token
    # of the first update weighs 2 / N_gen = 2 / (73 + 50) instead of 1 / 73
    report = audit_trl_grpo(
        "dapo", gradient_accumulation_steps=4, steps_per_generation=8, progress=False
    )
    assert not report.invariant and report.worst >= BROKEN_MIN, report
    assert report.generation_tokens == 123 and report.window_tokens == 73
    np.testing.assert_allclose(assert_weights(report), 2 * 73 / 123, rtol=1e-12)


@slow
def test_the_entropy_bonus_is_a_mean_of_micro_batch_means(trl):
    # the bonus: each micro-batch's token mean of the entropy, / GA (grpo_trainer.py:3189-3211),
    # whatever the loss type: grpo's policy cells stay at 1, the entropy cells do not
    report = audit_trl_grpo("grpo", gradient_accumulation_steps=4, entropy_coef=0.5, progress=False)
    assert not report.invariant and report.worst >= BROKEN_MIN, report
    weights = assert_weights(report)
    rows = report.tokens.size
    np.testing.assert_array_equal(weights[:rows], 1.0)  # the policy terms
    assert np.min(weights[rows:]) < 0.8 and np.max(weights[rows:]) > 2  # 73 / (4 T_mb)


@slow
def test_a_small_entropy_coefficient_keeps_its_weights_and_a_note(trl):
    # the entropy cells are fitted without their coefficient: at c = 1e-3 (TRL's adaptive
    # controller moves it by 5e-3) the weights are the formula's; the bonus is ~1e-3 of the
    # update, so the update's float32 rounding (~5e-7) over its share leaves ~5e-4 (measured
    # 3.2e-3 at most: 1e-2). At c = 1e-5 the update moves within the tolerance: INVARIANT,
    # with a note that the fit weighs the bonus's rows otherwise
    tiny, small = audit_trl_grpo_cuts(
        [GRPOCut("grpo", 4, entropy_coef=1e-5), GRPOCut("grpo", 4, entropy_coef=1e-3)],
        progress=False,
    )
    relative, _ = trl_prediction.predicted(small)
    np.testing.assert_allclose(small.weights[0], relative, rtol=1e-2)
    # the formula's weights span 0.70-2.28 (predicted); at c = 1e-5 the fit's noise moves the
    # low end a few percent (0.674 measured), so the note's range starts at 0.6
    assert tiny.invariant and "but its fit weighs rows 0.6" in str(tiny), tiny


@slow
def test_two_gloo_ranks_dapo_counts_globally_bnpo_locally(trl):
    # one launch of 2 ranks for both: dapo gathers num_items_in_batch over the ranks (and
    # divides by R, which DDP's mean undoes); bnpo divides by each rank's micro-batch tokens
    dapo, bnpo = audit_trl_grpo_cuts(
        [GRPOCut("dapo", 2, world_size=2), GRPOCut("bnpo", 2, world_size=2)], progress=False
    )
    assert dapo.invariant and dapo.worst <= INVARIANT_MAX, dapo
    np.testing.assert_array_equal(assert_weights(dapo), 1.0)
    assert sorted(map(tuple, dapo.microbatches)) == sorted(
        (rank, step) for rank in (0, 1) for step in (0, 1) for _ in range(4)
    )
    assert not bnpo.invariant and bnpo.worst >= BROKEN_MIN, bnpo
    assert_weights(bnpo)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"loss_type": "ppo"}, "loss_type: expected one of grpo, bnpo, dr_grpo, dapo, cispo"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps: expected an int"),
        ({"gradient_accumulation_steps": 3}, "GA x R to divide the update's 16 rows"),
        ({"world_size": 8}, "whole prompt groups"),
        ({"steps_per_generation": 3}, r"steps_per_generation: expected None, GA \(2\) or 2 GA"),
        ({"entropy_coef": math.nan}, "entropy_coef: expected a finite number"),
        ({"epsilon_high": -1.0}, "epsilon_high: expected None or a number > 0"),
        ({"epsilon_high": True}, "epsilon_high: expected None or a number > 0"),
        ({"steps_per_generation": 4.0}, r"steps_per_generation: expected None, GA \(2\) or 2 GA"),
    ],
)
def test_bad_arguments_are_refused_with_their_name(change, match):
    kwargs = {"loss_type": "dapo", "gradient_accumulation_steps": 2, **change}
    with pytest.raises(ValueError, match=match):
        check_cut(**kwargs)


def test_cispo_runs_with_scalerl_epsilon_high():
    # TRL's default epsilon_high = epsilon = 0.2 would weigh every token 0.2 at ratio 1
    assert check_cut("cispo", 1).epsilon_high == 5.0
    assert check_cut("dapo", 1).epsilon_high is None
