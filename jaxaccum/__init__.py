"""jaxaccum: gradient accumulation that is exactly the big-batch update.

Accumulate sums (gradient of the summed loss, summed loss, count of loss
units), add them across devices once per window, divide once.
"""

from jaxaccum import losses
from jaxaccum._accumulate import accumulate_gradients
from jaxaccum._grad import value_and_grad
from jaxaccum._multi_steps import (
    DynamicLossScale,
    MultiStepsState,
    WindowRecord,
    has_updated,
    loss_scale,
    multi_steps,
    partition_specs,
    window_metrics,
)
from jaxaccum._normalize import WindowTotals, normalize_window

__all__ = [
    "DynamicLossScale",
    "MultiStepsState",
    "WindowRecord",
    "WindowTotals",
    "accumulate_gradients",
    "has_updated",
    "loss_scale",
    "losses",
    "multi_steps",
    "normalize_window",
    "partition_specs",
    "value_and_grad",
    "window_metrics",
]

__version__ = "0.1.0"
