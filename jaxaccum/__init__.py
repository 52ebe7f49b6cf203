"""jaxaccum: gradient accumulation that is exactly the big-batch update.

Accumulate sums (the gradient of the summed loss, the summed loss and the
number of items it adds up), reduce them across devices once per window,
divide once. The math is in ``docs/math.md`` and ``jaxaccum/_normalize.py``.
"""

from jaxaccum import audit, losses
from jaxaccum._accumulate import accumulate_gradients
from jaxaccum._grad import value_and_grad
from jaxaccum._inner import WINDOW_LOSS
from jaxaccum._inspect import WindowLog, has_updated, loss_scale, window_metrics
from jaxaccum._loss_scale import DynamicLossScale
from jaxaccum._multi_steps import multi_steps
from jaxaccum._normalize import WindowTotals, normalize_window
from jaxaccum._partition_specs import partition_specs
from jaxaccum._restore import restore_state
from jaxaccum._state import MultiStepsState, SkipReason, WindowMetrics

__all__ = [
    "WINDOW_LOSS",
    "DynamicLossScale",
    "MultiStepsState",
    "SkipReason",
    "WindowLog",
    "WindowMetrics",
    "WindowTotals",
    "accumulate_gradients",
    "audit",
    "has_updated",
    "loss_scale",
    "losses",
    "multi_steps",
    "normalize_window",
    "partition_specs",
    "restore_state",
    "value_and_grad",
    "window_metrics",
]

__version__ = "0.2.0"
