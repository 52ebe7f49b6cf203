"""The vocabulary of a window's record, the same in jaxaccum and torch_ref."""

from __future__ import annotations

import enum

IGNORE_INDEX = -100
"""The label of a position that carries no loss (prompt, padding): PyTorch's and Hugging
Face's convention, and the default ``ignore_index`` of both frameworks' losses."""


class SkipReason(enum.IntEnum):
    """Why a window was or was not applied (a record's ``skip_reason``)."""

    APPLIED = 0
    """The window was applied: one optimizer update."""
    EMPTY = 1
    """The window's global ``num_items`` was 0: no item, no update."""
    NONFINITE = 2
    """The window gradient, its loss or its ``num_items`` was NaN or inf."""


RECORD_KEYS: tuple[str, ...] = (
    "micro_step",
    "update_id",
    "window_items",
    "cumulative_items",
    "loss",
    "grad_norm",
    "grad_norm_clipped",
    "skipped",
    "skip_count",
    "skip_reason",
    "loss_scale",
)
"""The keys of a window's record, in order (``jaxaccum.WindowMetrics``' fields)."""
