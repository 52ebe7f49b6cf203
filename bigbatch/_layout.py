"""Where the audit puts the user's rows: which device and micro-batch gets which row.

The known bugs differ only in how they weigh cells that hold different items
(``_forms.py``): on a window whose cells all hold the same items, the mean of
means *is* the big batch. So the audit lays the rows out to make the cells as
unequal as equal row counts allow (every cell gets the same number of rows:
shapes must not change between micro-batches). It sorts the rows by items and
hands out consecutive blocks: the emptiest blocks to the last device, the next
ones to device 0 (few items), the fullest to the devices in between. On one
device the micro-batches differ instead, the first one the emptiest. No cell is
left without items where the rows allow it: the weight of such a cell cannot be
seen, and a loop that drops it would pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from bigbatch._records import IGNORE_INDEX


def tail_microbatches(k: int) -> int:
    """The micro-batches of the short window the audit builds for ``k``: ``k // 2``, at least 1.

    Example:
      >>> tail_microbatches(4), tail_microbatches(3)
      (2, 1)
    """
    return max(1, k // 2)


class WindowShape:
    """The shape of a window, read off ``items`` (``[R, k_window]``) and the nominal ``k``."""

    items: np.ndarray
    k: int

    @property
    def num_devices(self) -> int:
        return int(self.items.shape[0])

    @property
    def k_window(self) -> int:
        """The micro-batches of this window (``k``, or fewer in a short window)."""
        return int(self.items.shape[1])

    @property
    def short_window(self) -> bool:
        return self.k_window < self.k


@dataclasses.dataclass(frozen=True, eq=False)
class CellLayout(WindowShape):
    """A window of the user's rows: ``R`` devices x ``k_window`` micro-batches x ``p`` rows.

    Attributes:
      rows: int64 ``[R, k_window, p]``, the batch rows of each cell (device
        ``r``, micro-batch ``m``).
      items: float64 ``[R, k_window]``, the items of each cell.
      k: the nominal micro-batches per window (``k_window`` is smaller in a
        short window).
      left_out: int64, the batch rows that are in no cell (the batch's rows
        beyond a multiple of the number of cells).
      first_labels: float64 ``[R, k_window]``, the rows of each cell whose label
        at position 0 is set (never a causal-LM target), or None when the rows'
        labels are not known.
    """

    rows: np.ndarray
    items: np.ndarray
    k: int
    left_out: np.ndarray
    first_labels: np.ndarray | None = None

    @property
    def rows_per_cell(self) -> int:
        return int(self.rows.shape[2])

    def microbatch_rows(self, m: int) -> np.ndarray:
        """The batch rows of micro-batch ``m``, global over the devices.

        Device ``r`` owns the contiguous slice ``[r * p, (r + 1) * p)`` (how
        data-parallel code splits a batch by default).
        """
        return self.rows[:, m, :].reshape(-1)


def layout_rows(
    row_items: np.ndarray,
    *,
    k: int,
    num_devices: int,
    short_window: bool = False,
    row_first_labels: np.ndarray | None = None,
) -> CellLayout:
    """Lays the rows out so that the cells differ strongly in items.

    Sorted by items, the rows are cut into ``C = R * k_window`` consecutive
    blocks of ``p = floor(B / C)`` rows (the rows in the middle of the order
    beyond ``C * p`` are left out). A block without items swaps a row for the
    row with the fewest items of a block holding two or more rows with items.
    Block ``j`` goes to device ``[R-1, 0, 1, ..., R-2][j // k_window]``,
    micro-batch ``j % k_window``.

    Args:
      row_items: ``[B]`` the items of each row of the batch (non-negative).
      k: the nominal micro-batches per window.
      num_devices: ``R``.
      short_window: build a short window of ``tail_microbatches(k)``
        micro-batches instead of ``k``.
      row_first_labels: ``[B]`` bool, the rows whose label at position 0 is set
        (:func:`first_labels_of` reads them off a batch), or None.

    Returns:
      A :class:`CellLayout`.

    Example:
      >>> import numpy as np
      >>> layout = layout_rows(np.array([3.0, 1.0, 0.0, 5.0]), k=2, num_devices=2)
      >>> layout.items  # the last device gets the emptiest rows
      array([[3., 5.],
             [0., 1.]])
      >>> layout.microbatch_rows(0)  # micro-batch 0: device 0's row, then device 1's
      array([0, 2])
    """
    row_items = np.asarray(row_items, np.float64)
    if row_items.ndim != 1 or np.any(row_items < 0) or not np.all(np.isfinite(row_items)):
        raise ValueError(
            "row_items: expected a 1-D array of finite, non-negative items per row;"
            f" got {row_items!r}"
        )
    k_window = tail_microbatches(k) if short_window else k
    cells = num_devices * k_window
    per_cell = row_items.size // cells
    if per_cell == 0:
        raise ValueError(
            f"batch: expected at least {cells} rows (num_devices={num_devices} x"
            f" {k_window} micro-batches, one row per cell at least); got {row_items.size}"
        )
    order = np.argsort(row_items, kind="stable")
    used = cells * per_cell
    low, high = used // 2, used - used // 2  # keep both ends of the order: the extremes
    kept = np.concatenate([order[:low], order[order.size - high :]])
    left_out = np.sort(order[low : order.size - high])
    blocks = _no_block_without_items(kept.reshape(cells, per_cell), row_items)
    device_order = [num_devices - 1, *range(num_devices - 1)]  # emptiest to the last device
    rows = np.empty((num_devices, k_window, per_cell), np.int64)
    for rank, device in enumerate(device_order):
        rows[device] = blocks[rank * k_window : (rank + 1) * k_window]
    first_labels = None
    if row_first_labels is not None:
        first_labels = np.asarray(row_first_labels, np.float64)[rows].sum(axis=-1)
    return CellLayout(
        rows=rows,
        items=row_items[rows].sum(axis=-1),
        k=int(k),
        left_out=left_out.astype(np.int64),
        first_labels=first_labels,
    )


def _no_block_without_items(blocks: np.ndarray, row_items: np.ndarray) -> np.ndarray:
    """``blocks`` (sorted by items) with no block left without items where the rows allow it.

    A cell without items has a zero gradient whatever a loop does with it, so a loop that
    drops it (a micro-batch lost to a misplaced ``zero_grad``, a device's rows never fed)
    would look exact. Each such block swaps one of its rows for the row with the fewest
    items among the blocks that hold two or more rows with items. With one row per cell
    (or too few rows with items) an empty cell stays, and the report says its weight
    is not seen.
    """
    blocks = blocks.copy()
    for empty in np.flatnonzero(row_items[blocks].sum(axis=1) == 0):
        items = row_items[blocks]
        donors = (items > 0).sum(axis=1, keepdims=True) >= 2
        candidates = np.where(donors & (items > 0), items, np.inf)
        if not np.isfinite(candidates.min()):
            break
        donor, j = np.unravel_index(np.argmin(candidates), candidates.shape)
        blocks[[empty, donor], [0, j]] = blocks[donor, j], blocks[empty, 0]
    return blocks


def first_labels_of(batch: Any) -> np.ndarray | None:
    """Which rows set their label at position 0: ``batch["labels"][:, 0] != -100``.

    None unless ``batch`` is a mapping with a ``[B, T]`` ``"labels"`` entry (the
    convention of Hugging Face and of both frameworks' causal-LM losses).

    Example:
      >>> first_labels_of({"labels": np.array([[5, 6], [-100, 7]])})
      array([ True, False])
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if labels is None or np.ndim(labels) != 2:
        return None
    return np.asarray(labels)[:, 0] != IGNORE_INDEX
