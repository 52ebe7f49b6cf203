"""The two libraries share one vocabulary: record keys, skip reasons, the loss-scale schedule."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: no CPU build for this Python here")


import jaxaccum  # noqa: E402
import torch_ref  # noqa: E402
from jaxaccum._loss_scale import next_loss_scale  # noqa: E402


def test_skip_reasons_are_the_same_enum():
    assert {r.name: r.value for r in jaxaccum.SkipReason} == {
        r.name: r.value for r in torch_ref.SkipReason
    }


def test_window_metrics_fields_are_the_torch_record_keys():
    # torch_ref's records add the learning rate, which jaxaccum's inner optimizer owns
    assert list(jaxaccum.WindowMetrics._fields) == [
        k for k in torch_ref.RECORD_KEYS if k != "learning_rate"
    ]


def gradscaler_scales(overflows, **config):
    """The scale after each step of a real ``torch.amp.GradScaler`` (one step per window)."""
    param = torch.nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", **config)
    scales = []
    for overflow in overflows:
        loss = param * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()  # a gradient of inf (or nan) on an overflow
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        optimizer.zero_grad()
    return scales


@pytest.mark.parametrize(
    "config, overflows",
    [
        # growth after 2 good windows, back-off on an overflow, the tracker reset by both
        (dict(init_scale=8.0, growth_interval=2), [0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0]),
        (
            dict(init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.25, growth_interval=1),
            [0, 1, 0, 0, 1, 1, 0],
        ),  # fmt: skip
        # a growth that would overflow float32 keeps the scale (and resets the tracker)
        (dict(init_scale=2.0**127, growth_interval=1), [0, 0, 1, 0]),
    ],
)
def test_loss_scale_schedule_is_gradscalers(config, overflows):
    ours = jaxaccum.DynamicLossScale(**config)
    scale, tracker, scales = jnp.float32(ours.init_scale), jnp.int32(0), []
    for overflow in overflows:
        scale, tracker = next_loss_scale(
            ours, scale, tracker, applied=not overflow, overflow=bool(overflow)
        )
        scales.append(float(scale))
    # exact: powers of two in float32, the same decisions
    np.testing.assert_array_equal(scales, gradscaler_scales(overflows, **config))
