"""What a window reports: the record, and the counters carried between windows.

The vocabulary is ``bigbatch``'s, shared with jaxaccum: the keys and meanings
of ``jaxaccum.WindowMetrics`` and the same `SkipReason`, plus ``learning_rate``,
which jaxaccum's inner optimizer owns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import bigbatch
from bigbatch import SkipReason

RECORD_KEYS: tuple[str, ...] = (*bigbatch.RECORD_KEYS, "learning_rate")
"""A record's keys: ``bigbatch.RECORD_KEYS`` (those of ``jaxaccum.WindowMetrics``) and the LR."""


@dataclasses.dataclass
class Progress:
    """Counters carried between windows (mutated in place by `train_update`).

    Attributes:
      micro_step: micro-batches processed on this rank since the start.
      update_id: optimizer updates really applied (a skipped window does not count).
      cumulative_items: global items summed over all APPLIED windows.
      skip_count: windows skipped so far (empty or non-finite).
    """

    micro_step: int = 0
    update_id: int = 0
    cumulative_items: float = 0.0
    skip_count: int = 0

    def advance(self, micro_batches: int, window_items: float, reason: SkipReason) -> None:
        """Counts a window: its micro-batches always; an update and its items only if applied."""
        self.micro_step += micro_batches
        if reason == SkipReason.APPLIED:
            self.update_id += 1
            self.cumulative_items += window_items
        else:
            self.skip_count += 1


def record(
    progress: Progress,
    window_items: float,
    loss: float,
    grad_norm: float,
    grad_norm_clipped: float,
    skip_reason: SkipReason,
    lr: float,
    loss_scale: float,
) -> dict[str, Any]:
    """The window record (`RECORD_KEYS`), from the counters after the window."""
    return {
        "micro_step": progress.micro_step,
        "update_id": progress.update_id,
        "window_items": float(window_items),
        "cumulative_items": float(progress.cumulative_items),
        "loss": float(loss),
        "grad_norm": float(grad_norm),
        "grad_norm_clipped": float(grad_norm_clipped),
        "skipped": skip_reason != SkipReason.APPLIED,
        "skip_count": progress.skip_count,
        "skip_reason": int(skip_reason),
        "loss_scale": float(loss_scale),
        "learning_rate": float(lr),
    }
