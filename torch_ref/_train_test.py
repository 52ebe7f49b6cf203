"""train_update / train in one process: big-batch equality, records, AMP, the tail window.

Gradients and deviations as in `tinygpt.torch_testing` (``window_grad``, ``rel_l2``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from parity_tests.torch_ranks import run_scenarios
from parity_tests.torch_scenario import AdamW, Scenario, WarmupCosine, split_window
from tinygpt.torch_gpt import TinyGPT, export_state_dict
from tinygpt.torch_testing import (
    CONFIG,
    LAYOUT_RTOL,
    flat_grad,
    microbatches,
    rel_l2,
    skewed_batch,
    window_grad,
)
from torch_ref import Progress, train, train_update

WEIGHTS = export_state_dict(TinyGPT(CONFIG, seed=0))


def _model() -> TinyGPT:
    return TinyGPT(CONFIG, seed=0)  # the numbers of WEIGHTS


def _flat_np(grads: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([grads[n].ravel() for n in WEIGHTS])


def _big_batch(ids: np.ndarray, labels: np.ndarray) -> tuple[float, torch.Tensor, int]:
    """Direct big-batch loss and gradient: sum of token CE / N, one forward."""
    model = _model()
    logits = model(torch.from_numpy(ids))[:, :-1].float()
    tgt = torch.from_numpy(labels)[:, 1:]
    n = int((tgt != -100).sum())
    loss = (
        F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            tgt.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        / n
    )
    loss.backward()
    return loss.item(), flat_grad(model), n


def test_window_equals_the_big_batch_gradient_and_record():
    ids, labels = skewed_batch(0)
    loss, g_ref, n = _big_batch(ids, labels)
    for k in (1, 2, 4, 8):
        rec, g = window_grad(microbatches(ids, labels, k))
        assert rec["window_items"] == n == 140  # counted exactly
        assert rel_l2(g, g_ref) <= LAYOUT_RTOL
        assert abs(rec["loss"] - loss) <= 1e-6 * loss  # float32 sums of 140 terms
        assert abs(rec["grad_norm"] - float(g_ref.norm())) <= LAYOUT_RTOL * float(g_ref.norm())
        assert rec["grad_norm_clipped"] == rec["grad_norm"]  # no clipping asked
        assert (rec["micro_step"], rec["update_id"], rec["skipped"]) == (k, 1, False)


def test_sample_unit_is_layout_invariant():
    ids, labels = skewed_batch(1)
    rec1, g1 = window_grad(microbatches(ids, labels, 1), unit="sample")
    rec4, g4 = window_grad(microbatches(ids, labels, 4), unit="sample")
    assert rec1["window_items"] == rec4["window_items"] == 6.0  # 6 samples have labels
    assert rel_l2(g4, g1) <= LAYOUT_RTOL
    assert abs(rec4["loss"] - rec1["loss"]) <= 1e-6 * rec1["loss"]  # float32 rounding


def test_float64_layouts_agree_to_float64_rounding():
    ids, labels = skewed_batch(16)
    base = dict(
        config=CONFIG, weights=WEIGHTS, optimizer=AdamW(lr=1e-3, weight_decay=0.1), precision="fp64"
    )
    one, four = run_scenarios([
        Scenario(**base, windows=[split_window(ids, labels, 1, 1)] * 3),
        Scenario(**base, windows=[split_window(ids, labels, 1, 4)] * 3),
    ])  # fmt: skip
    assert one.params[-1]["wte.weight"].dtype == np.float64
    dev = max(np.abs(one.params[-1][n] - four.params[-1][n]).max() for n in WEIGHTS)
    # float64 rounding: measured 2.7e-15 (float32 gives 1.8e-6 on the same run);
    # 1e-12 leaves 300x headroom and would fail any float32 step by 6 decades.
    assert dev <= 1e-12
    assert abs(one.records[-1]["loss"] / four.records[-1]["loss"] - 1) <= 1e-13


def test_clipping_uses_the_window_norm():
    ids, labels = skewed_batch(2)
    rec, g = window_grad(microbatches(ids, labels, 4))
    max_norm = rec["grad_norm"] / 4
    rec_c, g_c = window_grad(microbatches(ids, labels, 4), max_grad_norm=max_norm)
    assert rec_c["grad_norm"] == rec["grad_norm"]  # reported before clipping, same op order
    # clipped = norm * (max / norm): float32/float64 rounding only.
    assert abs(rec_c["grad_norm_clipped"] - max_norm) <= 1e-6 * max_norm
    assert abs(float(g_c.norm()) - max_norm) <= 1e-5 * max_norm  # float32 norm of scaled grads
    assert rel_l2(g_c, g / 4) <= 1e-6  # same direction: a pure rescale by 1/4
    rec_n, _ = window_grad(microbatches(ids, labels, 4), max_grad_norm=10 * rec["grad_norm"])
    assert rec_n["grad_norm_clipped"] == rec_n["grad_norm"]  # under the threshold: untouched


def test_counters_and_lr_schedule_over_windows():
    ids, labels = skewed_batch(3)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: (t + 1) / 4)
    progress = Progress()
    recs = train(model, microbatches(ids, labels, 8), opt, k=3, scheduler=sched, progress=progress)
    # 8 micro-batches, k=3 -> windows of 3, 3, 2 (tail kept).
    assert [r["micro_step"] for r in recs] == [3, 6, 8]
    assert [r["update_id"] for r in recs] == [1, 2, 3]
    counts = [r["window_items"] for r in recs]
    assert counts == [49.0, 31.0, 60.0]  # samples (2,47,0) (0,30,1) (20,40)
    assert [r["cumulative_items"] for r in recs] == [49.0, 80.0, 140.0]
    # LR used by update t is lr * (t + 1) / 4: the scheduler moved once per update.
    assert [r["learning_rate"] for r in recs] == pytest.approx([2.5e-3, 5e-3, 7.5e-3], rel=1e-12)
    assert progress == Progress(micro_step=8, update_id=3, cumulative_items=140.0)


def test_empty_window_raises_or_skips():
    ids, labels = skewed_batch(5)
    empty = microbatches(ids[2:4], labels[2:4], 2)  # samples 2 and 3 have no valid label
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="the window has no items"):
        train_update(model, empty, opt)
    progress = Progress(micro_step=5, update_id=2, cumulative_items=7.0)
    rec = train_update(model, empty, opt, empty_window="skip", progress=progress)
    assert progress == Progress(micro_step=7, update_id=2, cumulative_items=7.0, skip_count=1)
    assert (rec["skipped"], rec["skip_reason"], rec["skip_count"]) == (True, 1, 1)
    # as jaxaccum: no items, no mean loss (NaN), a zero gradient
    assert (rec["window_items"], rec["grad_norm"]) == (0.0, 0.0) and math.isnan(rec["loss"])
    after = export_state_dict(model)
    assert max(np.abs(after[n] - WEIGHTS[n]).max() for n in after) == 0.0  # no step at all
    with pytest.raises(ValueError, match="empty_window: expected 'raise' or 'skip'"):
        train_update(model, empty, opt, empty_window="ignore")


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), "1", True])
def test_a_bad_max_grad_norm_is_refused_naming_it(bad):
    # -1 flipped the update, 0 zeroed it, NaN clipped nothing (min(1, nan) is 1): all silent
    ids, labels = skewed_batch(5)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="max_grad_norm: expected None .* or a number > 0"):
        train_update(model, microbatches(ids, labels, 2), opt, max_grad_norm=bad)


def test_tail_window_is_weighted_by_its_real_count():
    """5 micro-batches, k=2: windows (2, 2, 1). The tail equals its own big batch."""
    ids, labels = skewed_batch(6, valid=(5, 40, 3, 12, 30), seq_len=48)
    mbs = microbatches(ids, labels, 5)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    recs = train(model, mbs, opt, k=2)
    assert [r["window_items"] for r in recs] == [45.0, 15.0, 30.0]
    _, g_tail = window_grad(mbs[4:])  # the tail alone, as a (1, 1) window
    assert rel_l2(flat_grad(model), g_tail) <= LAYOUT_RTOL

    dropped = train(
        _model(), mbs, torch.optim.SGD(_model().parameters(), lr=0.0), k=2, drop_last=True
    )
    assert [r["micro_step"] for r in dropped] == [2, 4]  # tail dropped, not stepped


def test_fp16_scaler_skips_an_inf_window_without_moving_counters():
    ids, labels = skewed_batch(7)
    windows = [split_window(ids, labels, 1, 2) for _ in range(4)]
    base = dict(config=CONFIG, weights=WEIGHTS, windows=windows, optimizer=AdamW(lr=1e-3),
                schedule=WarmupCosine(warmup_steps=2, decay_steps=6))  # fmt: skip
    fp16, fp16_inf = run_scenarios([
        Scenario(**base, precision="fp16"),
        Scenario(**base, precision="fp16", inf_microbatches=frozenset({(1, 0, 1)}),
                 record_grads=True),
    ])  # fmt: skip
    r = fp16_inf.records
    assert [x["skipped"] for x in r] == [False, True, False, False]
    assert [x["update_id"] for x in r] == [1, 1, 2, 3]
    assert [x["micro_step"] for x in r] == [2, 4, 6, 8]  # micro-steps do count
    assert [x["cumulative_items"] for x in r] == [140.0, 140.0, 280.0, 420.0]
    # The schedule did not move on the skip: window 2 uses the LR window 1 would have.
    assert r[2]["learning_rate"] == r[1]["learning_rate"] == fp16.records[1]["learning_rate"]
    assert r[3]["learning_rate"] == fp16.records[2]["learning_rate"]
    # loss_scale is the scale for the next window: one backoff (x0.5, exact) at the skip.
    assert [x["loss_scale"] for x in r] == [2.0**16, 2.0**15, 2.0**15, 2.0**15]
    assert [x["skip_reason"] for x in r] == [0, 2, 0, 0]
    assert [x["skip_count"] for x in r] == [0, 1, 1, 1]
    # No step: the parameters are bitwise those of window 0.
    assert max(np.abs(fp16_inf.params[1][n] - fp16_inf.params[0][n]).max() for n in WEIGHTS) == 0.0
    # as jaxaccum: the record says what the window computed, nothing was clipped
    assert not math.isfinite(r[1]["loss"]) and not math.isfinite(r[1]["grad_norm"])
    np.testing.assert_equal(r[1]["grad_norm_clipped"], r[1]["grad_norm"])  # NaN == NaN here
    assert not np.isfinite(_flat_np(fp16_inf.grads[1])).all()  # the poisoned gradient itself


def test_loss_scale_is_constant_inside_a_window():
    ids, labels = skewed_batch(8)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    seen: list[float] = []
    poison = {"on": True}

    def hook(_m, _i, out):
        seen.append(scaler.get_scale())
        if poison["on"]:  # first micro-batch of the first window overflows
            poison["on"] = False
            return out * float("inf")
        return out

    model.register_forward_hook(hook)
    rec0 = train_update(model, microbatches(ids, labels, 4), opt, scaler=scaler)
    rec1 = train_update(model, microbatches(ids, labels, 4), opt, scaler=scaler)
    # An update inside the window would have halved the scale after micro-batch 0.
    assert seen == [1024.0] * 4 + [512.0] * 4
    assert (rec0["skipped"], rec1["skipped"]) == (True, False)
    assert (rec0["loss_scale"], rec1["loss_scale"]) == (512.0, 512.0)  # the NEXT window's scale


def test_an_init_scale_float32_cannot_hold_does_not_skip_the_first_window():
    # GradScaler keeps its scale in float32: 0.7 becomes 0.69999998..., which is no back-off.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=0.7)
    rec = train_update(model, microbatches(*skewed_batch(0), 2), opt, scaler=scaler)
    assert (rec["skipped"], rec["update_id"], rec["loss_scale"]) == (False, 1, scaler.get_scale())


def test_low_precision_runs_stay_close_to_fp32():
    ids, labels = skewed_batch(9)
    windows = [split_window(ids, labels, 1, 2) for _ in range(3)]
    base = dict(
        config=CONFIG, weights=WEIGHTS, windows=windows, optimizer=AdamW(lr=1e-3), record_grads=True
    )
    fp32, bf16, fp16, scaled32 = run_scenarios([
        Scenario(**base), Scenario(**base, precision="bf16"), Scenario(**base, precision="fp16"),
        Scenario(**base, grad_scaler=True),
    ])  # fmt: skip

    def grad_dev(res) -> float:  # window 0: same starting weights, so only precision differs
        a = np.concatenate([res.grads[0][n].ravel() for n in WEIGHTS])
        b = np.concatenate([fp32.grads[0][n].ravel() for n in WEIGHTS])
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    def param_dev(res) -> float:
        return float(max(np.abs(res.params[-1][n] - fp32.params[-1][n]).max() for n in WEIGHTS))

    # fp32 + GradScaler: scaling by 2^16 and back is exact in float32 (powers of 2).
    assert param_dev(scaled32) == 0.0 and scaled32.records[0]["loss_scale"] == 2.0**16
    # Autocast matmuls: bf16 unit roundoff 2^-8 = 3.9e-3 (measured 4.4e-3 on the
    # gradient), fp16 2^-11 = 4.9e-4 (measured 5.5e-4, GradScaler on).
    assert grad_dev(bf16) <= 2e-2
    assert grad_dev(fp16) <= 3e-3
    # Loss in float32 from low-precision logits (measured 1.3e-5 and 1.6e-7).
    assert abs(bf16.records[0]["loss"] / fp32.records[0]["loss"] - 1) <= 1e-3
    assert abs(fp16.records[0]["loss"] / fp32.records[0]["loss"] - 1) <= 1e-4
    # Adam moves a weight by at most ~lr per update, so two runs differ by at
    # most 2 * lr * 3 updates = 6e-3 (measured 2.6e-3 bf16, 2.0e-3 fp16).
    assert param_dev(bf16) <= 6e-3
    assert param_dev(fp16) <= 6e-3
