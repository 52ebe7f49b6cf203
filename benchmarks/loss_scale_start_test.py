"""fp16 loss scaling at the start of a run: jaxaccum skips what GradScaler skips.

``benchmarks.loss_scale_start`` runs the same fp16 MLP and data through PyTorch
``GradScaler`` on a mean loss (a), ``jaxaccum.value_and_grad(..., loss_scale=)``
(b) and the old ``jax.value_and_grad`` of ``scale * loss_sum`` (c), side by
side. The counts are deterministic (fixed weights and data, no timing).
"""

import math

import pytest

pytest.importorskip("torch", reason="needs torch: no CPU build for this Python here")

from benchmarks import loss_scale_start  # noqa: E402

pytestmark = pytest.mark.slow  # about 15 s: 4 runs of ~20 windows of 4 x n rows, 4 compilations

K = 4


@pytest.fixture(scope="module", params=[512, 4096], ids=lambda n: f"n={n}")
def measured(request):
    return loss_scale_start.measure(request.param, k=K)


def test_the_setting_makes_grad_scaler_itself_skip(measured):
    a = measured["methods"]["torch_mean"]
    # targets of ~48 give a first gradient ~96: GradScaler skips a few windows at 2**16,
    # so "(b) skips as many" is a statement about overflow, not 0 == 0
    assert a["start_skips"] >= 3, a
    # the count is the float16 one (65520 overflows), predicted from the float64 gradient:
    # torch.autocast really runs the backward in float16 on CPU
    assert a["start_skips"] == a["predicted_start_skips"], a
    # the threshold is far from a power of two: fp16 rounding (2**-11 relative, 0.0007
    # octaves) and the window-to-window change of the data's largest gradient (~1% at
    # n=512, 0.015 octaves) cannot move a window across it
    assert a["margin_octaves"] >= 0.1, a
    # every method reached its first applied window: no count is cut off by max_windows
    assert all(m["applied"] >= 5 for m in measured["methods"].values()), measured
    # (a') mean / k: backward values k times smaller, log2(k) fewer halvings (torch only)
    assert measured["methods"]["torch_mean_over_k"]["start_skips"] == a["start_skips"] - 2


def test_jaxaccum_skips_as_many_windows_as_grad_scaler(measured):
    a, b = measured["methods"]["torch_mean"], measured["methods"]["jaxaccum"]
    # Exact: the backward of scale * loss_sum / n carries the values of GradScaler's on
    # the mean loss up to fp16 rounding, and the threshold is >= 0.1 octaves from a power of
    # two (asserted above); after the first applied window the scale (2000-window growth
    # interval) never changes again in either run.
    assert b["start_skips"] == a["start_skips"], (a, b)
    assert b["total_skips"] == a["total_skips"], (a, b)


def test_old_summed_loss_backward_skips_log2_n_more(measured):
    n = measured["n_items"]
    a, c = measured["methods"]["torch_mean"], measured["methods"]["jax_old"]
    # The summed loss's gradient is n times the mean's: log2(n) more halvings (exactly, for
    # n a power of two). Two windows of slack, as asked: one for rounding log2 of the ratio
    # to whole halvings (n not a power of two, or a threshold within rounding of one), one
    # for the data of the windows at the threshold. The new code, (b), has 0 extra.
    assert c["start_skips"] - a["start_skips"] >= math.log2(n) - 2, (a, c)
