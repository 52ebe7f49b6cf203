"""The layout: equal rows per cell, cells as unequal as that allows, the emptiest last, and
no cell without items where the rows allow it."""

from __future__ import annotations

import numpy as np
import pytest

import bigbatch

SKEWED = np.array([0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 8, 9, 10, 11], float)


def test_four_devices_one_empty_one_with_few():
    layout = bigbatch.layout_rows(SKEWED, k=4, num_devices=4)
    assert layout.rows.shape == (4, 4, 1) and layout.left_out.size == 0
    # exact integers: the last device gets the 4 rows without an item, device 0 the next fewest;
    # one row per cell, so the last device's cells stay without items (nothing to swap)
    np.testing.assert_array_equal(layout.items.sum(axis=1), [6, 18, 38, 0])
    assert np.all(layout.items[-1] == 0)
    assert sorted(layout.rows.reshape(-1).tolist()) == list(range(16))  # every row once


def test_one_device_the_microbatches_differ():
    layout = bigbatch.layout_rows(SKEWED, k=4, num_devices=1)
    # 4 rows each: the block of the 4 rows without an item takes the next block's row of 1 item
    np.testing.assert_array_equal(layout.items, [[1, 5, 18, 38]])


def test_a_block_without_items_takes_a_row_with_the_fewest():
    layout = bigbatch.layout_rows(SKEWED, k=4, num_devices=2)  # 2 rows per cell, 2 empty blocks
    np.testing.assert_array_equal(layout.items, [[7, 11, 17, 21], [1, 2, 1, 2]])
    assert sorted(layout.rows.reshape(-1).tolist()) == list(range(16))  # every row once
    # too few rows with items to give each cell one: the cells left over stay empty
    layout = bigbatch.layout_rows(np.array([0, 0, 0, 0, 0, 0, 3, 5], float), k=4, num_devices=1)
    np.testing.assert_array_equal(layout.items, [[3, 0, 0, 5]])  # 3 swapped into the first


def test_microbatch_rows_are_contiguous_device_slices():
    layout = bigbatch.layout_rows(SKEWED, k=2, num_devices=2)
    rows = layout.microbatch_rows(1)
    # device 0's 4 rows of micro-batch 1, then device 1's
    np.testing.assert_array_equal(rows, np.concatenate([layout.rows[0, 1], layout.rows[1, 1]]))
    np.testing.assert_array_equal(SKEWED[rows[:4]].sum(), layout.items[0, 1])


def test_rows_beyond_a_multiple_of_the_cells_are_left_out_from_the_middle():
    items = np.arange(10, dtype=float)  # 10 rows into 4 cells of 2: rows 4 and 5 left out
    layout = bigbatch.layout_rows(items, k=4, num_devices=1)
    np.testing.assert_array_equal(layout.left_out, [4, 5])
    np.testing.assert_array_equal(layout.items, [[1, 5, 13, 17]])  # 0+1, 2+3, 6+7, 8+9


def test_short_window():
    layout = bigbatch.layout_rows(SKEWED, k=4, num_devices=1, short_window=True)
    assert layout.k_window == bigbatch.tail_microbatches(4) == 2 and layout.short_window
    np.testing.assert_array_equal(layout.items, [[6, 56]])  # 8 rows each


def test_too_few_rows():
    with pytest.raises(ValueError, match="batch: expected at least 8 rows"):
        bigbatch.layout_rows(np.ones(7), k=4, num_devices=2)


@pytest.mark.parametrize(
    "cuts",
    [[(1, 1)], [(2, 1), (1, 1)], [(True, 2)], [(2, 0)], [], [(2,)]],
    ids=["one cell", "one cell among others", "a bool", "zero devices", "none", "not a pair"],
)
def test_cuts_of_one_cell_bools_or_zeros_are_refused(cuts):
    # a cut of one cell is the one-batch run compared with itself: it always agrees
    with pytest.raises(ValueError, match=r"cuts: expected a non-empty list of \(k, R\) pairs"):
        bigbatch.check_cuts(cuts, rows=16)
    assert bigbatch.check_cuts([(np.int64(2), 2)], rows=16) == [(2, 2)]  # numpy ints are ints


def test_row_items_from_labels_refuse_another_ignore_index():
    # labels padded with -1: every position would count, every row the same, and a mean of
    # means would pass the invariance audit on rows whose real items differ
    labels = np.array([[5, 1, -1, -1], [5, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"batch: its 'labels' hold \[-1\].*row_items="):
        bigbatch.row_items_of({"labels": labels}, None, rows=2)
    counted = bigbatch.row_items_of({"labels": np.where(labels < 0, -100, labels)}, None, rows=2)
    np.testing.assert_array_equal(counted, [1.0, 3.0])  # targets after the shift


def test_an_invariance_report_of_a_zero_update_is_refused():
    zero = [np.zeros(2)]
    with pytest.raises(ValueError, match="one-batch run's update has norm 0: nothing to compare"):
        bigbatch.invariance_report(["k=2 x R=1"], zero, [zero], row_items=np.ones(2))
