"""The bugs of `torch_ref.buggy`, one process: each changes the update as its entry says.

Gradients and deviations as in `tinygpt.torch_testing`; the DDP bugs (local
denominator, forgotten DDP average, no_sync around backward only) are in
``ddp_test.py``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import bigbatch
from tinygpt import torch_testing as testing
from tinygpt.torch_gpt import TinyGPT
from tinygpt.torch_testing import (
    CONFIG,
    LAYOUT_RTOL,
    microbatches,
    rel_l2,
    skewed_batch,
    window_grad,
)
from torch_ref import train, train_update
from torch_ref.buggy import REFERENCE, VARIANTS, Variant, variant


def variant_weights(v: Variant, items: np.ndarray, nominal_k: int) -> np.ndarray:
    """Each cell's weight per item under ``v``'s objective, after DDP's mean over the ``R``
    ranks, in units of the big batch's ``1/N``: NaN for a cell without items."""
    num_ranks, k = items.shape
    window_items = float(items.sum())
    weights = np.full(items.shape, np.nan)
    for r, m in itertools.product(range(num_ranks), range(k)):
        divisors = v.divisors(window_items, float(items[r].sum()), k, nominal_k)
        scale = v.objective_scale(divisors, int(items[r, m]), num_ranks)
        weights[r, m] = scale / num_ranks * window_items
    return np.where(items > 0, weights, np.nan)


@pytest.mark.parametrize(
    "items, nominal_k",
    [
        ([[127.0, 5.0], [544.0, 3.0]], 2),  # a full window, 2 ranks
        ([[10.0, 30.0]], 4),  # a tail of 2 micro-batches of k = 4
        ([[10.0, 30.0], [7.0, 100.0]], 4),
        ([[300.0], [40.0]], 2),  # a one-micro-batch tail on 2 ranks
    ],
)
def test_every_variant_weighs_the_cells_as_its_form(items, nominal_k):
    # the audit names a loop by bigbatch.form_weights: each variant of that name must be it,
    # short windows included (float64 of small integers: 1e-12 is rounding room only)
    items = np.array(items)
    for name in ("exact", *bigbatch.BUG_NAMES):
        v = REFERENCE if name == "exact" else VARIANTS.get(name)
        if v is None:  # mean_of_global_means: a global view of a micro-batch, JAX's jit only
            continue
        expected = bigbatch.form_weights(name, items, k=nominal_k)
        np.testing.assert_allclose(variant_weights(v, items, nominal_k), expected, rtol=1e-12)


def test_mean_of_means_deviates_on_skewed_lengths_and_logs_the_mean_of_means():
    ids, labels = skewed_batch(10)
    window = microbatches(ids, labels, 4)
    _, g = window_grad(window)
    rec_b, g_b = window_grad(window, variant=VARIANTS["mean_of_means"])
    # Micro-batch items 49, 0, 31, 60: weights per token 1/(4*49), 1/(4*31),
    # 1/(4*60) instead of 1/140, and the empty micro-batch still takes a 1/4 share.
    assert rel_l2(g_b, g) >= 0.1  # >= 1e4 x LAYOUT_RTOL
    # Its logged loss is the mean of the 4 micro-batch means (the empty one counts as 0),
    # computed here by torch's own mean cross entropy.
    model = TinyGPT(CONFIG, seed=0)
    means = []
    for mb in window:
        logits, target = model(mb["input_ids"])[:, :-1], mb["labels"][:, 1:]
        if (target != -100).any():
            means.append(F.cross_entropy(logits.reshape(-1, 256), target.reshape(-1)).item())
    assert abs(rec_b["loss"] - sum(means) / 4) <= 1e-6 * rec_b["loss"]  # float32 rounding


def test_missing_1_over_k_is_exactly_k_times():
    ids, labels = skewed_batch(11)
    k = 4
    rec_m, g_m = window_grad(microbatches(ids, labels, k), variant=VARIANTS["mean_of_means"])
    rec_x, g_x = window_grad(microbatches(ids, labels, k), variant=VARIANTS["missing_1_over_k"])
    assert rel_l2(g_x, k * g_m) <= 1e-6  # the 1/k is the only difference: rounding only
    assert abs(rec_x["loss"] - k * rec_m["loss"]) <= 1e-6 * rec_x["loss"]
    # With equal items per micro-batch, that is k x the correct gradient (DAPO: 0.42 -> 1.68).
    eq = microbatches(*skewed_batch(12, valid=(10, 20, 15, 15, 5, 25, 12, 18)), k)
    rec, g = window_grad(eq)
    rec_e, g_e = window_grad(eq, variant=VARIANTS["missing_1_over_k"])
    assert rel_l2(g_e, k * g) <= LAYOUT_RTOL
    assert abs(rec_e["loss"] / rec["loss"] - k) <= 1e-5  # float32 means vs one sum


def test_clip_per_microbatch_is_the_sum_of_clipped_microbatch_gradients():
    ids, labels = skewed_batch(13)
    window = microbatches(ids, labels, 4)
    rec, g = window_grad(window)
    max_norm = rec["grad_norm"] / 2
    _, g_c = window_grad(window, max_grad_norm=max_norm)
    _, g_b = window_grad(window, max_grad_norm=max_norm, variant=VARIANTS["clip_per_microbatch"])
    assert rel_l2(g_b, g_c) >= 0.05  # direction and size both change
    # The oracle: each micro-batch's share of the window gradient, grad(loss_sum_m / N),
    # clipped alone by torch.nn.utils.clip_grad_norm_, then added.
    total = torch.zeros_like(g)
    for mb in window:
        model = TinyGPT(CONFIG, seed=0)
        logits, target = model(mb["input_ids"])[:, :-1], mb["labels"][:, 1:]
        loss_sum = F.cross_entropy(
            logits.reshape(-1, 256), target.reshape(-1), ignore_index=-100, reduction="sum"
        )
        (loss_sum / rec["window_items"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        total += testing.flat_grad(model)
    assert rel_l2(g_b, total) <= LAYOUT_RTOL  # float32: the same sums in another order


def test_fixed_divisor_tail_halves_a_half_length_tail():
    """5 micro-batches, k=2: windows (2, 2, 1); Accelerate's divisor gives the tail 1/2."""
    mbs = microbatches(*skewed_batch(6, valid=(5, 40, 3, 12, 30), seq_len=48), 5)
    bug = "fixed_divisor_tail"
    recs, recs_b = [
        train(model, mbs, torch.optim.SGD(model.parameters(), lr=0.0), k=2, variant=v)
        for model, v in [(TinyGPT(CONFIG), REFERENCE), (TinyGPT(CONFIG), VARIANTS[bug])]
    ]
    assert abs(recs_b[2]["grad_norm"] / recs[2]["grad_norm"] - 0.5) <= 1e-6  # float32 rounding
    for u in (0, 1):  # full windows are right: the same ops up to float32 rounding
        assert abs(recs_b[u]["grad_norm"] / recs[u]["grad_norm"] - 1) <= 1e-6


def test_scheduler_per_microbatch_runs_k_times_too_fast():
    ids, labels = skewed_batch(14)
    lrs = {}
    for v in (REFERENCE, VARIANTS["scheduler_per_microbatch"]):
        model = TinyGPT(CONFIG)
        opt = torch.optim.AdamW(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (t + 1))
        recs = train(model, microbatches(ids, labels, 8), opt, k=4, scheduler=sched, variant=v)
        lrs[v.name] = [r["learning_rate"] for r in recs] + [opt.param_groups[0]["lr"]]
    # exact: 1/(t+1) in float64, the same division on both sides
    assert lrs["reference"] == [1.0, 1 / 2, 1 / 3]  # updates 0, 1, then the next LR
    assert lrs["scheduler_per_microbatch"] == [1 / 5, 1 / 9, 1 / 9]  # 4 micro-steps per update


def _poison(model: torch.nn.Module, forward: int) -> None:
    """Multiplies the logits of the model's ``forward``-th forward (from 0) by +inf: that
    micro-batch's loss and gradient become NaN (the parity suite's injection)."""
    count = itertools.count()
    model.register_forward_hook(
        lambda _m, _i, out: out * float("inf") if next(count) == forward else out
    )


def _scaled_update(window, poisoned: int, variant: Variant):
    """(record, window gradient) of one update, SGD lr 0, a GradScaler at 2**10, an inf in
    micro-batch ``poisoned``."""
    model = TinyGPT(CONFIG, seed=0)
    _poison(model, poisoned)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    record = train_update(model, window, opt, scaler=scaler, variant=variant)
    return record, testing.flat_grad(model)


def test_skip_per_microbatch_applies_the_window_with_the_finite_microbatches_sums():
    window = microbatches(*skewed_batch(16), 4)  # items 49, 0, 31, 60: N = 140
    rec, g = _scaled_update(window, 2, REFERENCE)
    rec_b, g_b = _scaled_update(window, 2, VARIANTS["skip_per_microbatch"])
    # The reference drops the window: no update, and the scale backs off (x0.5, exact).
    assert (rec["skipped"], rec["update_id"], rec["loss_scale"]) == (True, 0, 512.0)
    assert not torch.isfinite(g).all()
    # The bug drops micro-batch 2 alone and applies the rest; the scale does not back off.
    assert (rec_b["skipped"], rec_b["update_id"], rec_b["loss_scale"]) == (False, 1, 1024.0)
    # By hand: the reference window of micro-batches 0, 1, 3 (N' = 109) divides by 109; the bug
    # divides their sums by the whole window's N = 140, so it is 109/140 of that.
    rec_w, g_w = window_grad([window[0], window[1], window[3]])
    assert (rec_w["window_items"], rec_b["window_items"]) == (109.0, 140.0)
    # float32: 1/140 and 1/109 rounded, and the scale 2**10 (measured 3.5e-7 and 0)
    assert rel_l2(g_b, g_w * 109 / 140) <= LAYOUT_RTOL
    assert abs(rec_b["loss"] - rec_w["loss"] * 109 / 140) <= 1e-6 * rec_b["loss"]


def test_the_per_window_and_per_micro_batch_schedulers_move_on_skipped_windows():
    # One-sample micro-batches (items 2, 47, 0, 0, 30, 1, 20, 40), k=2: windows 0 and 3 are
    # applied, window 1 is empty, window 2 holds an inf (forward 2: window 1 runs no forward).
    ids, labels = skewed_batch(17)
    recs, lrs = {}, {}
    for v in (REFERENCE, VARIANTS["scheduler_per_window"], VARIANTS["scheduler_per_microbatch"]):
        model = TinyGPT(CONFIG)
        _poison(model, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (t + 1))
        recs[v.name] = train(model, microbatches(ids, labels, 8), opt, k=2, scheduler=sched,
                             empty_window="skip", variant=v)  # fmt: skip
        lrs[v.name] = [r["learning_rate"] for r in recs[v.name]] + [opt.param_groups[0]["lr"]]
    for name in lrs:  # the same windows skipped, the same count of applied updates
        assert [r["skip_reason"] for r in recs[name]] == [0, 1, 2, 0]
        assert [r["update_id"] for r in recs[name]] == [1, 1, 1, 2]
    # exact: 1/(t+1) in float64, the same division on both sides
    assert lrs["reference"] == [1.0, 1 / 2, 1 / 2, 1 / 2, 1 / 3]  # windows 0-3, then the next LR
    assert lrs["scheduler_per_window"] == [1.0, 1 / 2, 1 / 3, 1 / 4, 1 / 5]
    # 2 steps per window, the empty one's too (it records the LR before its steps): 2 + 2 +
    # 2 + 2 = 8 steps, 1/9 after them
    assert lrs["scheduler_per_microbatch"] == [1 / 3, 1 / 3, 1 / 7, 1 / 9, 1 / 9]


def test_skipping_per_micro_batch_changes_nothing_without_an_inf():
    # The parity suite runs the two overflow-only bugs on its loss-scaling scenario, where a
    # window overflows (scheduler_per_window's LRs without a skip: the test above).
    names = [n for n, v in VARIANTS.items() if v.overflow_only]
    assert names == ["skip_per_microbatch", "scheduler_per_window"]
    window = microbatches(*skewed_batch(18), 4)
    rec, g = window_grad(window)
    rec_b, g_b = window_grad(window, variant=VARIANTS["skip_per_microbatch"])
    # bitwise: the same micro-batch gradients, added as g_m + sum instead of sum + g_m
    assert torch.equal(g_b, g) and rec_b["loss"] == rec["loss"]


def test_only_no_sync_backward_only_keeps_the_numbers():
    # The parity suite judges this one by its all-reduce count, every other bug by its numbers.
    assert [n for n, v in VARIANTS.items() if v.communication_only] == ["no_sync_backward_only"]
    assert REFERENCE.communication_only is False


def test_bad_variants_and_their_missing_settings_are_refused():
    window = microbatches(*skewed_batch(15), 1)
    model = TinyGPT(CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="bug: expected None or one of"):
        variant("typo")
    with pytest.raises(ValueError, match="Variant.clip: expected one of"):
        Variant(clip="sometimes")
    with pytest.raises(ValueError, match="variant: expected a torch_ref.buggy.Variant"):
        train_update(model, window, opt, variant="mean_of_means")
    with pytest.raises(ValueError, match="nominal_k"):
        train_update(model, window, opt, variant=VARIANTS["fixed_divisor_tail"])
    with pytest.raises(ValueError, match="needs max_grad_norm and no scaler"):
        train_update(model, window, opt, variant=VARIANTS["clip_per_microbatch"])
