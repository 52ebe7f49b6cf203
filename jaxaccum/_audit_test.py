"""The audit recovers how each known JAX accumulation loop weighs its cells, and names it.

Every loop runs one SGD update of the tiny LM of ``testkit`` on the audit's
layout of the same rows (a row with ``n`` valid tokens has labels at positions
``1..n``). The bug loops are written as they are found in the wild
(``testkit.audited_loops``, shared with the parity suite's audit table); the
expected weights are the formulas of ``docs/math.md`` (``bigbatch.form_weights``).
The loops are a user's code, so they run under JAX's standard numerics; the
audit itself runs under the session's strict ones.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bigbatch
import jaxaccum
from bigbatch import IGNORE_INDEX
from testkit import audited_loops as loops
from testkit import (
    standard_numerics,
    tiny_lm_logits,
    tiny_lm_loss,
    tiny_lm_params,
)
from testkit.audited_loops import sgd_step, tree_sum

pytestmark = pytest.mark.slow  # every audit runs and differentiates a loop: make test only

# The weights of a float32 loop come out within ~1e-6 (relative) of their
# formula (float32 gradients summed in another order, the update read back as
# new - old); 1e-4 leaves 100x room and is still 500x below the 5% by which the
# audit's layout separates any two forms.
WEIGHT_RTOL = 1e-4
# A reweighting's relative residual is float32 rounding, ~1e-7..1e-6; 1e-4 is the
# same margin (the audit's own threshold, RESIDUAL_RTOL, is 1e-3).
RESIDUAL_MAX = 1e-4
# What a loop that is no reweighting leaves at the least: 50x the audit's threshold.
RESIDUAL_MIN = 0.05
SEQ_LEN = 12
K = 4  # micro-batches per window; the audit's short window has 2


def rows(tokens: list[int], seed: int = 0) -> dict[str, np.ndarray]:
    """A batch of ``len(tokens)`` rows; row ``i`` holds ``tokens[i]`` valid tokens."""
    rng = np.random.default_rng(seed)
    positions = np.arange(SEQ_LEN)
    valid = (positions >= 1) & (positions <= np.asarray(tokens)[:, None])
    labels = np.where(valid, rng.integers(0, 13, (len(tokens), SEQ_LEN)), IGNORE_INDEX)
    inputs = rng.integers(0, 13, (len(tokens), SEQ_LEN))
    return {"tokens": inputs.astype(np.int32), "labels": labels.astype(np.int32)}


# 16 rows, all with tokens (a mean per micro-batch stays finite): the one-device loops
FULL_TOKENS = [1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 11]
FULL = rows(FULL_TOKENS)
# 16 rows, four without a token: the layout spreads them, no cell is without a token
SKEWED = rows([0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 8, 9, 10, 11], seed=1)
# one row per cell of a one-device window of K, the first without a token: a cell stays empty
ONE_EMPTY = rows([0, 1, 3, 5], seed=2)
PARAMS = tiny_lm_params()


def audit(window_fn, batch=FULL, **kwargs) -> bigbatch.AuditReport:
    """``audit_window`` with the tiny LM's summed loss, the user's loop under standard numerics."""

    def users_code(*args):
        with standard_numerics():
            return window_fn(*args)

    return jaxaccum.audit.audit_window(users_code, tiny_lm_loss, PARAMS, batch, **kwargs)


def assert_recovers(report: bigbatch.AuditReport, name: str) -> None:
    """The verdict is ``name`` and every weight is that form's (``WEIGHT_RTOL``)."""
    assert report.verdict == name, report
    weights = bigbatch.form_weights(name, report.items, k=report.k)
    np.testing.assert_allclose(report.weights, weights, rtol=WEIGHT_RTOL)
    assert report.residual <= RESIDUAL_MAX, report  # a reweighting, to float32 rounding


mean_loss = loops.mean_of(tiny_lm_loss)  # what most loops differentiate: the micro-batch's mean
nanogpt_window = loops.mean_of_means(tiny_lm_loss)
missing_1_over_k_window = loops.missing_1_over_k(tiny_lm_loss)
optax_multisteps_window = loops.optax_multisteps(tiny_lm_loss, K)
fixed_divisor_tail_window = loops.fixed_divisor_tail(tiny_lm_loss, K)


def jaxaccum_window(mode: str, num_devices: int = 1):
    """jaxaccum's micro-step in ``mode`` (``testkit.data_parallel``)."""
    return loops.jaxaccum_window(tiny_lm_loss, K, mode, num_devices)


# ---- one device ---------------------------------------------------------------------------------


def test_hand_checked_two_microbatches_of_3_and_1_tokens():
    # N = 4. The mean of means weighs a token of the 1-token micro-batch 1/(2*1) = 2/N and
    # one of the 3-token micro-batch 1/(2*3) = (2/3)/N; the layout puts the short one first.
    report = audit(nanogpt_window, rows([3, 1]), k=2)
    np.testing.assert_array_equal(report.items, [[1.0, 3.0]])
    np.testing.assert_allclose(report.weights, [[2.0, 2.0 / 3.0]], rtol=WEIGHT_RTOL)
    assert report.verdict == "mean_of_means" and not report.passed
    assert abs(report.scale - 1.0) <= WEIGHT_RTOL  # (1 * 2 + 3 * 2/3) / 4 = 1
    assert abs(report.max_weight_error - 1.0) <= WEIGHT_RTOL  # the 1-token cell: 2x, off by 1
    # a missing 1/k would weigh N/n_c = 4 and 4/3: both cells are off by half of that
    assert abs(report.form_errors["missing_1_over_k"] - 0.5) <= WEIGHT_RTOL
    assert "an item of micro-batch 0 at 2.00x the big batch" in str(report), report
    assert "| 0 | 0 | 1 | 2.00x | 1.00x | 2.00x |" in report.to_markdown()
    assert len(repr(report)) <= 240  # what pytest shows of `assert report.passed, report`


@pytest.mark.parametrize(
    "window_fn, name",
    [
        (nanogpt_window, "mean_of_means"),
        (optax_multisteps_window, "mean_of_means"),
        (missing_1_over_k_window, "missing_1_over_k"),
    ],
    ids=["nanogpt", "optax_multisteps", "missing_1_over_k"],
)
def test_one_device_bugs_are_recovered(window_fn, name):
    report = audit(window_fn, k=K)
    assert_recovers(report, name)
    # the layout makes the micro-batches differ strongly
    np.testing.assert_array_equal(report.items, [[6.0, 15.0, 30.0, 43.0]])


def test_jaxaccum_on_one_device_is_the_big_batch():
    report = audit(jaxaccum_window("one_device"), SKEWED, k=K)
    assert report.passed, report
    assert_recovers(report, "exact")
    # the four rows without a token are spread: every cell holds one, and its weight is seen
    assert report.empty_cells == [] and np.all(report.items > 0)
    # float32: the update is the big batch's to ~1e-7 relative; 1e-5 leaves 100x room
    assert report.update_error <= 1e-5


def masked_mean_window(params, microbatches, optimizer):
    """A common port: ``(token_loss * mask).sum() / mask.sum()`` per micro-batch, then / k."""

    def masked_mean(p, mb):
        logits, labels = tiny_lm_logits(p, mb["tokens"])[:, :-1], mb["labels"][:, 1:]
        mask = (labels != IGNORE_INDEX).astype(jnp.float32)
        token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
        return jnp.sum(token_loss * mask) / jnp.sum(mask) / len(microbatches)

    grads = [jax.grad(masked_mean)(params, mb) for mb in microbatches]
    return sgd_step(params, tree_sum(grads), optimizer)


def test_a_loop_that_drops_a_micro_batch_without_items_here_fails():
    # a misplaced zero_grad loses micro-batch 0; the layout put SKEWED's emptiest rows there,
    # and a cell without items would hide the loss (its gradient is zero whatever its weight)

    def drops_first(params, microbatches, optimizer):  # right, but for micro-batch 0
        kept = microbatches[1:]
        grads = [jax.grad(lambda p, mb: tiny_lm_loss(p, mb)[0])(params, mb) for mb in kept]
        items = sum(tiny_lm_loss(params, mb)[1] for mb in kept)
        return sgd_step(params, jax.tree.map(lambda g: g / items, tree_sum(grads)), optimizer)

    report = audit(drops_first, SKEWED, k=K)
    assert not report.passed and report.verdict != "exact", report
    assert report.max_weight_error >= 1.0 - WEIGHT_RTOL  # micro-batch 0 weighs 0, not 1/N
    assert "verdict: unknown: micro-batch 0 weighed 0: a gradient that never reached" in str(report)


def test_a_count_frozen_at_the_first_window_fails():
    # the window's count read inside jax.jit from Python: captured at the first trace, every
    # later window divides by the first one's N. The audit runs the loop on a window of other
    # items first (micro-batch 3, the busiest, K times), so the audited one is divided by that
    counts = {}

    @jax.jit
    def micro_grad(params, mb):
        return jax.grad(lambda p: tiny_lm_loss(p, mb)[0] / counts["window"])(params)

    def frozen_count(params, microbatches, optimizer):
        counts["window"] = float(sum(tiny_lm_loss(params, mb)[1] for mb in microbatches))
        grads = [micro_grad(params, mb) for mb in microbatches]
        return sgd_step(params, tree_sum(grads), optimizer)

    report = audit(frozen_count, FULL, k=K)
    items = report.items.sum(axis=0)  # per micro-batch
    kept = items.sum() / (K * items.max())  # N over the warm-up window's count, which it kept
    # every item weighed less: a clip of the window, or a count off; not passed either way
    assert not report.passed and report.clipped_once, report
    assert abs(report.clip_scale - kept) <= WEIGHT_RTOL * kept, report
    # told the loop does not clip: no known form, and the note names a count kept
    report = audit(frozen_count, FULL, k=K, max_grad_norm=math.inf)
    assert report.verdict == "unknown" and not report.passed, report
    assert "a count kept from an earlier window" in str(report), report


def test_an_error_of_the_loop_on_the_warm_up_window_says_which_window_that_was():
    def distinct_micro_batches_only(params, microbatches, optimizer):
        if np.array_equal(microbatches[0]["tokens"], microbatches[1]["tokens"]):
            raise ValueError("the same micro-batch twice")
        return params

    with pytest.raises(ValueError, match="the same micro-batch twice") as raised:
        audit(distinct_micro_batches_only, FULL, k=K)
    (note,) = raised.value.__notes__
    assert note.startswith("(raised in the audit's warm-up: your loop on micro-batch 3 repeated")


def test_a_loop_that_pops_its_labels_runs_as_in_training():
    # a compute_loss override's pattern: each run gets dicts of its own to pop from
    def pops_labels(params, microbatches, optimizer):
        popped = [{"tokens": mb.pop("tokens"), "labels": mb.pop("labels")} for mb in microbatches]
        return jaxaccum_window("one_device")(params, popped, optimizer)

    assert_recovers(audit(pops_labels, FULL, k=K), "exact")


def test_a_loop_that_donates_its_params_after_its_first_call_is_refused():
    # a loop that keeps its params' buffers on its first call gets the audit's own params
    # after it (a copy less): a donation then would delete the point changes are read from
    calls = []

    def donates_later(params, microbatches, optimizer):
        new = jaxaccum_window("one_device")(params, microbatches, optimizer)
        calls.append(len(calls))
        if len(calls) == 2:
            jax.tree.map(lambda x: x.delete(), params)  # what donate_argnums does to them
        return new

    own = jax.tree.map(jnp.copy, PARAMS)  # the audit's, deleted by the loop: not the module's
    with pytest.raises(ValueError, match="it donated the `params` it was given on this call"):
        jaxaccum.audit.audit_window(donates_later, tiny_lm_loss, own, FULL, k=K, progress=False)


def test_params_below_float32_are_refused_naming_the_dtype():
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
    with pytest.raises(ValueError, match="params: expected float32 or wider.*bfloat16"):
        jaxaccum.audit.audit_window(jaxaccum_window("one_device"), tiny_lm_loss, bf16, FULL, k=K)


def test_a_mean_of_means_with_an_empty_microbatch():
    # one row per cell: ONE_EMPTY's first micro-batch has no token. causal_lm masks with a
    # select, so its 0/0 mean has a zero gradient: the audit names the bug from the other cells
    report = audit(nanogpt_window, ONE_EMPTY, k=K)
    assert_recovers(report, "mean_of_means")
    assert report.empty_cells == [(0, 0)]
    # a mask multiplied in turns the 0/0 into a NaN gradient (inf * 0): reported, not fitted
    report = audit(masked_mean_window, ONE_EMPTY, k=K)
    assert report.verdict == "unknown" and not report.finite and not report.passed
    assert np.all(np.isnan(report.weights)) and report.residual == np.inf
    assert "NaN" in str(report) and "micro-batch 0" in str(report), report


# ---- a short tail window ------------------------------------------------------------------------


def test_fixed_divisor_on_a_short_tail_window():
    report = audit(fixed_divisor_tail_window, k=K, short_window=True)
    assert report.k_window == 2 and report.k == K
    assert_recovers(report, "fixed_divisor_tail")
    assert abs(report.scale - 0.5) <= WEIGHT_RTOL  # k_tail / k = 2 / 4 of its gradient


def test_jaxaccum_end_window_normalizes_a_tail_by_its_own_items():
    report = audit(jaxaccum_window("one_device"), k=K, short_window=True)
    assert report.passed, report
    assert_recovers(report, "exact")


def test_optax_multisteps_never_closes_a_short_window():
    report = audit(optax_multisteps_window, k=K, short_window=True)
    assert report.verdict == "unknown" and not report.moved
    np.testing.assert_array_equal(report.weights, np.zeros((1, 2)))  # no update: exactly 0
    assert "did not change the parameters" in str(report), report


# ---- data parallel ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "loop, num_devices, name, scale, device_items",
    [
        # the empty device still counts in the average: 3 of 4 quarters remain
        (loops.local_denominator, 4, "local_denominator", 0.75, [6, 18, 38, 0]),
        (loops.ddp_average_forgotten, 2, "ddp_average_forgotten", 0.5, [56, 6]),  # 1 / R
    ],
    ids=["local_denominator", "ddp_average_forgotten"],
)
def test_data_parallel_bugs_under_shard_map(loop, num_devices, name, scale, device_items):
    window_fn = loop(tiny_lm_loss, num_devices)
    report = audit(window_fn, SKEWED, k=K, num_devices=num_devices)
    assert_recovers(report, name)
    assert abs(report.scale - scale) <= WEIGHT_RTOL
    # the layout: the emptiest rows on the last device (all 4 without a token, when 4 rows
    # fill it), the next on device 0, the fullest in between
    np.testing.assert_array_equal(report.items.sum(axis=1), device_items)


@pytest.mark.parametrize(
    "mode, num_devices", [("shard_map", 4), ("jit", 2)], ids=["shard_map_4", "explicit_jit_2"]
)
def test_jaxaccum_data_parallel_is_the_big_batch(mode, num_devices):
    report = audit(jaxaccum_window(mode, num_devices), FULL, k=K, num_devices=num_devices)
    assert report.passed, report
    assert_recovers(report, "exact")
    assert report.update_error <= 1e-5  # float32, as on one device


def test_a_device_without_items_leaves_the_exact_window_not_confirmed():
    # SKEWED on 4 devices: the last holds its 4 rows without a token; a loop that drops
    # that device's gradient would weigh every item the same
    report = audit(jaxaccum_window("shard_map", 4), SKEWED, k=K, num_devices=4)
    assert_recovers(report, "exact")
    assert report.unchecked == ["device 3"] and not report.passed
    assert report.summary().startswith("NOT CONFIRMED, exact"), report.summary()


# ---- not a reweighting --------------------------------------------------------------------------


def adam_window(params, microbatches, optimizer):
    """Ignores the contract: Adam's first step is about ``-lr * sign(g)``, not linear in g."""
    del optimizer
    grads = [jax.grad(lambda p, mb=mb: tiny_lm_loss(p, mb)[0])(params) for mb in microbatches]
    return sgd_step(params, tree_sum(grads), optax.adam(1e-2))


CLIP = 0.02  # a micro-batch mean's gradient elements: median ~0.013, 24% to 44% above 0.02


def elementwise_clip_window(params, microbatches, optimizer):
    """Clips every gradient element of each micro-batch (``optax.clip``) before adding."""
    clip = optax.clip(CLIP)
    grads = [clip.update(jax.grad(mean_loss)(params, mb), None)[0] for mb in microbatches]
    return sgd_step(params, tree_sum(grads), optimizer)


def test_a_loop_that_is_no_reweighting_is_unknown_with_a_large_residual():
    report = audit(elementwise_clip_window, k=K)
    assert report.verdict == "unknown" and not report.passed
    assert report.residual >= RESIDUAL_MIN, report
    assert "not a reweighting" in str(report), report


def step_per_microbatch(loss_fn):
    """A loop of ``loss_sum / N`` per micro-batch and an SGD step after each: no accumulation."""

    def window_fn(params, microbatches, optimizer):
        n = sum(loss_fn(params, mb)[1] for mb in microbatches)
        state = optimizer.init(params)
        for mb in microbatches:
            grads = jax.grad(lambda p, mb=mb: loss_fn(p, mb)[0] / n)(params)
            updates, state = optimizer.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return params

    return window_fn


def carried_sum_window():
    """The big batch, with a gradient sum that is never reset: the next window adds it in."""
    carried = []

    def window_fn(params, microbatches, optimizer):
        grads = [jax.grad(lambda p, mb=mb: tiny_lm_loss(p, mb)[0])(params) for mb in microbatches]
        carried.extend(grads)
        n = sum(tiny_lm_loss(params, mb)[1] for mb in microbatches)
        return sgd_step(params, jax.tree.map(lambda g: g / n, tree_sum(carried)), optimizer)

    return window_fn


@pytest.mark.parametrize(
    "window_fn, learning_rate, match",
    [  # Adam's first step is ~ -lr sign(g) whatever lr the audit passes: it is not SGD's
        (adam_window, 1.0, "does not use the optimizer the audit passes"),
        (step_per_microbatch(tiny_lm_loss), 0.05, "steps more than once per window"),
        # each run adds in the earlier runs' gradients (the warm-up window's too): far off
        (carried_sum_window(), 1.0, r"learning rate by [1-9]\.\de-01.*gradient sum"),
    ],
    ids=["adam", "step per micro-batch", "carried sum"],
)
def test_a_loop_whose_update_is_not_lr_times_its_window_gradient_is_refused(
    window_fn, learning_rate, match
):
    with pytest.raises(ValueError, match=f"not proportional to the learning rate.*{match}"):
        audit(window_fn, k=K, learning_rate=learning_rate)


def linear_loss(params, batch):
    """A masked linear regression: a SUM over valid tokens, and their count."""
    err = (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2
    return jnp.sum(err * batch["mask"]), jnp.sum(batch["mask"])


LINEAR_TOKENS = np.array([0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 12])


def linear_batch() -> dict[str, np.ndarray]:
    """16 rows of 12 positions, ``LINEAR_TOKENS`` of them valid: ``linear_loss``'s rows."""
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(16, 12, 16)).astype(np.float32),
        "y": rng.normal(size=(16, 12)).astype(np.float32),
        "mask": (np.arange(12) < LINEAR_TOKENS[:, None]).astype(np.float32),
    }


def test_stepping_per_micro_batch_at_a_small_learning_rate_no_longer_passes():
    # zero parameters (nothing to round) and lr 1e-4: the steps compound by ~1e-4 of the
    # update, within the fit's 1e-3, and the audit used to say PASSED, exact (the red team's)
    batch, params = linear_batch(), {"w": jnp.zeros(16), "b": jnp.zeros(())}
    with pytest.raises(ValueError, match="steps more than once per window"):
        jaxaccum.audit.audit_window(
            step_per_microbatch(linear_loss), linear_loss, params, batch, k=4,
            learning_rate=1e-4, progress=False,
        )  # fmt: skip


def test_the_invariance_audit_refuses_stepping_per_micro_batch_at_a_small_learning_rate():
    # the cuts differ by ~lr x curvature: at lr 1e-5 from zero parameters, 9e-7 of the update,
    # within INVARIANCE_RTOL, and the audit used to say INVARIANT (the red team's); each cut
    # now runs at LR_SCALE x the rate first, as audit_window's loop does
    batch, params, tokens = linear_batch(), {"w": jnp.zeros(16), "b": jnp.zeros(())}, LINEAR_TOKENS
    invariance = lambda window_fn, **kw: jaxaccum.audit.audit_invariance(
        window_fn, params, batch, cuts=[(4, 1)], progress=False, **kw
    )
    with pytest.raises(ValueError, match="steps more than once per window"):
        invariance(step_per_microbatch(linear_loss), loss_fn=linear_loss, learning_rate=1e-5)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="learning_rate: expected a finite number > 0"):
            invariance(step_per_microbatch(linear_loss), learning_rate=bad)
    with pytest.raises(ValueError, match="row_items: pass it or loss_fn, not both"):
        invariance(step_per_microbatch(linear_loss), loss_fn=linear_loss, row_items=tokens)
    # a loop that does not step: a one-batch update of norm 0, nothing to compare with
    with pytest.raises(ValueError, match="one-batch run's update has norm 0"):
        invariance(lambda p, microbatches, optimizer: p, row_items=tokens)


# ---- arguments ----------------------------------------------------------------------------------


def mean_loss_fn(params, batch):
    """A mean and 1 "item" per batch: what the audit must refuse as a reference loss."""
    loss_sum, num_items = tiny_lm_loss(params, batch)
    return loss_sum / num_items, num_items / num_items


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(k=0), "k: expected a positive int"),
        (dict(k=1), "k: a window of k=1"),
        (dict(num_devices=2.0), "num_devices: expected a positive int"),
        (dict(learning_rate=-1.0), "learning_rate: expected a finite number > 0"),
        (dict(learning_rate=1e-9), "learning_rate: the big-batch update"),
        (dict(short_window=1), "short_window: expected a bool"),
        (dict(window_fn=None), "window_fn: expected a function"),
        (
            dict(batch={"tokens": np.zeros((4, 3)), "labels": np.zeros((5, 3))}),
            "same number of rows",
        ),
        (dict(batch=rows([1, 2, 3])), "batch: expected at least 4 rows"),
        (dict(batch=rows([5] * 8)), "batch: its rows are too alike"),
        (dict(batch=rows([0] * 8)), "batch: no row has an item"),
        (dict(loss_fn=mean_loss_fn), "loss_fn: expected a summed loss"),
        (dict(loss_fn=lambda p, b: tiny_lm_loss(p, b)[0]), r"loss_fn: expected \(loss_sum"),
        (dict(params={"w": np.zeros(3, np.int32)}), "params: expected float arrays"),
        (dict(window_fn=lambda p, mbs, opt: p["embed"]), "window_fn: expected new parameters"),
    ],
)
def test_bad_arguments_are_refused_with_their_name(change, match):
    kwargs = dict(window_fn=nanogpt_window, loss_fn=tiny_lm_loss, params=PARAMS, batch=FULL, k=K)
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        jaxaccum.audit.audit_window(**kwargs)
