"""What the audit's fit needs from the cells' gradients, in memory that does not grow with cells.

The fit (``_fit.py``) has one unknown per cell, so it needs inner products
only: the Gram matrix ``A = G^T G`` of the cells' gradients and ``G^T d``, ``|d|``
for the loop's deviation from the big batch

    d = -update / lr - sum_c G_c / N        (zero for a loop that is the big batch)

:func:`cell_products` streams the cells' gradients: it holds ``d`` (float64,
built in place from the update) and as many gradients as ``CELL_MEMORY``
allows, at least one; a gradient that cannot stay is computed again for the
products it still owes. Memory: ``8 P`` bytes for ``d`` plus ``4 P`` per held
float32 gradient, whatever the number of cells; time: ``C`` gradients when all
fit, ``C (C + 1) / 2`` when one does.

Precision: the products of float32 numbers are exact in float64 and are added
pairwise in chunks, then exactly (``math.fsum``): each product carries a
relative error of ~1e-15. ``d`` is formed element by element (no cancellation),
so the update's distance to the big batch is exact to that; quantities that the
fit forms from products (the residual) carry an absolute error of about
``sqrt(1e-15) |d|``, three orders of magnitude below float32 rounding.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence

import numpy as np

from bigbatch._layout import CellLayout

CELL_MEMORY = 2**29
"""Bytes of cell gradients held at once (512 MiB); at least one gradient is held."""

_CHUNK = 2**16  # elements added pairwise in float64 before the exact sum over chunks

Leaves = Sequence[np.ndarray]
CellGrad = Callable[[int, int], Leaves]
"""``cell_grad(device, micro_batch)``: the leaves of the gradient of that cell's summed loss."""


@dataclasses.dataclass(frozen=True)
class CellProducts:
    """The inner products of one audit, over the cells with items in ``layout`` order.

    Attributes:
      cells: ``[C, 2]`` int, the ``(device, micro_batch)`` of each cell with items.
      gram: ``[C, C]`` float64, ``G_c . G_c'``.
      deviation: ``[C]`` float64, ``G_c . d``.
      deviation_norm: ``|d|``; NaN when the update is not finite.
      update_norm: ``|update| / lr``; NaN when the update is not finite.
      passes: the cell gradients computed (more than ``C`` when not all could be held).
    """

    cells: np.ndarray
    gram: np.ndarray
    deviation: np.ndarray
    deviation_norm: float
    update_norm: float
    passes: int


def dot(a: Leaves, b: Leaves) -> float:
    """``sum(a * b)`` over every leaf in float64: pairwise within chunks, exact across them.

    Example:
      >>> dot([np.ones(3, np.float32)], [np.arange(3.0)])
      3.0
    """
    partial = []
    for x, y in zip(a, b, strict=True):
        x, y = np.ravel(x), np.ravel(y)
        for start in range(0, x.size, _CHUNK):
            chunk = slice(start, start + _CHUNK)
            partial.append(float(np.sum(x[chunk].astype(np.float64) * y[chunk])))
    return math.fsum(partial)


def cell_products(
    cell_grad: CellGrad,
    update: list[np.ndarray],
    layout: CellLayout,
    *,
    learning_rate: float,
    progress: bool = True,
) -> CellProducts:
    """Streams the cells' gradients into the products of :class:`CellProducts`.

    Args:
      cell_grad: the gradient of a cell's summed reference loss, as arrays in the
        order of ``update`` (float32 or float64; any shape per leaf).
      update: the loop's parameter change ``new - old`` per leaf, float64. It is
        CONSUMED: turned into ``d`` in place (no copy of the parameters' size).
      layout: the cells (only those with items are computed).
      learning_rate: the SGD learning rate the loop was given.
      progress: a tqdm bar on stderr while the gradients are computed.

    Returns:
      The :class:`CellProducts`.
    """
    cells = np.argwhere(layout.items > 0)
    per_cell = 1.0 / float(layout.items.sum())
    update[:] = [np.ascontiguousarray(leaf, np.float64) for leaf in update]  # no copy if so
    finite = all(np.all(np.isfinite(leaf)) for leaf in update)
    update_norm = math.sqrt(dot(update, update)) / learning_rate if finite else math.nan
    for leaf in update:  # d = -update / lr (then minus each cell's share, in `_Stream.first`)
        leaf *= -1.0 / learning_rate if finite else 0.0
    gram, to_partial, passes = stream_products(
        cell_grad, cells, [update], share=per_cell, progress=progress
    )
    deviation = to_partial[0] - per_cell * np.triu(gram).sum(axis=1)
    return CellProducts(
        cells=cells,
        gram=gram,
        deviation=deviation,
        deviation_norm=math.sqrt(dot(update, update)) if finite else math.nan,
        update_norm=update_norm,
        passes=passes,
    )


def stream_products(
    cell_grad: CellGrad,
    cells: np.ndarray,
    targets: list[list[np.ndarray]],
    *,
    share: float = 0.0,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The cells' Gram matrix and their products with ``targets``, streamed.

    Holds as many gradients as ``CELL_MEMORY`` allows (at least one) and
    computes again those that cannot stay. At a cell's first gradient (in
    index order) its products with the targets are taken, then ``share`` of
    it is subtracted from ``targets[0]`` in place (float64): the products are
    with ``targets[0] - share * sum_{j<c} G_j`` (:func:`cell_products`).

    Args:
      cell_grad: ``cell_grad(*cells[c])``, the leaves of cell ``c``'s gradient.
      cells: ``[C, ...]`` int, the arguments of each cell.
      targets: float64 leaves (contiguous), in the order of the gradients' leaves.
      share: what ``targets[0]`` loses of each gradient (0: it is left as it is).
      progress: a tqdm bar on stderr.

    Returns:
      ``(gram [C, C], to_targets [U, C], passes)``.
    """
    stream = _Stream(cell_grad, cells, targets, share, progress)
    stream.run()
    return stream.gram, stream.to_targets, stream.passes


class _Stream:
    """The blocks of held gradients and the passes over the cells after each block."""

    def __init__(self, cell_grad, cells, targets, share, progress):
        self.cell_grad, self.cells, self.targets, self.share = cell_grad, cells, targets, share
        self.gram = np.zeros((len(cells), len(cells)))
        self.to_targets = np.zeros((len(targets), len(cells)))
        self.seen, self.passes, self.held_at_once = 0, 0, len(cells)
        self.bar = _bar(len(cells), progress)

    def run(self) -> None:
        start = 0
        with self.bar:
            while start < len(self.cells):
                held: list[tuple[int, Leaves]] = []
                while start < len(self.cells) and len(held) < self.held_at_once:
                    held.append((start, self.grad(start)))
                    for c, g in held:
                        self.gram[start, c] = self.gram[c, start] = dot(held[-1][1], g)
                    start += 1
                for j in range(start, len(self.cells)):  # the products the held ones owe
                    g = self.grad(j)
                    for c, h in held:
                        self.gram[j, c] = self.gram[c, j] = dot(g, h)

    def grad(self, c: int) -> Leaves:
        """Cell ``c``'s gradient; at its first computation, its products with the targets."""
        g = [np.asarray(leaf) for leaf in self.cell_grad(*(int(i) for i in self.cells[c]))]
        self.passes += 1
        if self.passes == 1:
            cell_bytes = sum(leaf.nbytes for leaf in g)
            self.held_at_once = max(1, min(len(self.cells), CELL_MEMORY // max(cell_bytes, 1)))
            self.bar.total = _passes(len(self.cells), self.held_at_once)
        if c == self.seen:
            self.to_targets[:, c] = [dot(g, target) for target in self.targets]
            if self.share:
                _subtract(self.targets[0], self.share, g)
            self.seen += 1
        self.bar.update()
        return g


def _subtract(target: list[np.ndarray], share: float, g: Leaves) -> None:
    """``target -= share * g`` in float64, in place, chunk by chunk."""
    for leaf_t, leaf_g in zip(target, g, strict=True):
        flat_t, flat_g = leaf_t.reshape(-1), np.ravel(leaf_g)
        for start in range(0, flat_t.size, _CHUNK):
            chunk = slice(start, start + _CHUNK)
            flat_t[chunk] -= share * flat_g[chunk].astype(np.float64)


def _passes(cells: int, held: int) -> int:
    """The gradients computed for ``cells`` cells holding ``held`` at once."""
    return cells + sum(cells - min(cells, start + held) for start in range(0, cells, held))


def _bar(total: int, progress: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc="audit: cell gradients",
        unit="grad",
        file=sys.stderr,
        disable=not progress,
    )
