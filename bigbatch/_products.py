"""What the audit's fit needs from the cells' gradients, in memory that does not grow with cells.

The fit (``_fit.py``) has one unknown per cell, so it needs inner products
only: the Gram matrix ``A = G^T G`` of the cells' gradients, their products
``b = G^T t`` with the loop's update as a gradient (``t = -update / lr``) and
``|t|``. :func:`cell_products` streams the cells' gradients: it holds as many
as ``CELL_MEMORY`` allows, at least one, and computes again a gradient that
cannot stay for the products it still owes. Memory: the update (in the
parameters' dtype) and ``4 P`` bytes per held float32 gradient, whatever the
number of cells; time: ``C`` gradients when all fit, ``C (C + 1) / 2`` when one
does.

Precision: the products of float32 numbers are exact in float64 and are added
pairwise in chunks, then exactly (``math.fsum``): each product carries a
relative error of ~1e-15, so what the fit forms from them by difference (the
distance to the big batch, the residual) carries an absolute error of about
``sqrt(1e-15) |t|``, ~3e-8 of the update: below float32 rounding.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
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
      to_update: ``[C]`` float64, ``G_c . t`` with ``t = -update / lr``.
      update_norm: ``|t|``; NaN when the update is not finite.
      passes: the cell gradients computed (more than ``C`` when not all could be held).
    """

    cells: np.ndarray
    gram: np.ndarray
    to_update: np.ndarray
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


def parameter_change(new: list, old: Sequence) -> list[np.ndarray]:
    """``new - old`` per leaf, in the parameters' dtype (at least float32), leaf by leaf.

    ``new`` is CONSUMED: each of its leaves is let go once used, so that the
    parameters after the update (and what they hold alive) are freed as the
    change is built. The difference of two float32 numbers within a factor 2
    of each other is exact (Sterbenz), so for an update small against the
    parameters no rounding is added to what the parameters' dtype allows.
    Leaves are anything ``np.asarray`` reads (numpy, jax, CPU torch tensors).

    Example:
      >>> parameter_change([np.float32([1.5])], [np.float32([1.0])])
      [array([0.5], dtype=float32)]
    """
    change = []
    for old_leaf in old:
        new_leaf, old_leaf = np.asarray(new.pop(0)), np.asarray(old_leaf)
        dtype = np.promote_types(np.result_type(new_leaf, old_leaf), np.float32)
        change.append(np.subtract(new_leaf, old_leaf, dtype=dtype))
        del new_leaf
    return change


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
      update: the loop's parameter change ``new - old`` per leaf
        (:func:`parameter_change`).
      layout: the cells (only those with items are computed).
      learning_rate: the SGD learning rate the loop was given.
      progress: a tqdm bar on stderr while the gradients are computed.

    Returns:
      The :class:`CellProducts`.
    """
    cells = np.argwhere(layout.items > 0)
    finite = all(np.all(np.isfinite(leaf)) for leaf in update)
    target = update if finite else [np.zeros_like(leaf) for leaf in update]
    gram, to_targets, passes = stream_products(cell_grad, cells, [target], progress=progress)
    return CellProducts(
        cells=cells,
        gram=gram,
        to_update=-to_targets[0] / learning_rate,
        update_norm=math.sqrt(dot(update, update)) / learning_rate if finite else math.nan,
        passes=passes,
    )


def stream_products(
    cell_grad: CellGrad,
    cells: np.ndarray,
    targets: Sequence[Leaves],
    *,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The cells' Gram matrix and their products with ``targets``, streamed.

    Holds as many gradients as ``CELL_MEMORY`` allows (at least one) and
    computes again those that cannot stay; the products with the targets are
    taken at a cell's first gradient.

    Args:
      cell_grad: ``cell_grad(*cells[c])``, the leaves of cell ``c``'s gradient.
      cells: ``[C, ...]`` int, the arguments of each cell.
      targets: leaves in the order of the gradients' leaves (e.g. updates).
      progress: a tqdm bar on stderr.

    Returns:
      ``(gram [C, C], to_targets [U, C], passes)``.
    """
    stream = _Stream(cell_grad, cells, targets, progress)
    stream.run()
    return stream.gram, stream.to_targets, stream.passes


class _Stream:
    """The blocks of held gradients and the passes over the cells after each block."""

    def __init__(self, cell_grad, cells, targets, progress):
        self.cell_grad, self.cells, self.targets = cell_grad, cells, targets
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
                    self.products(start, held[-1][1], held)
                    start += 1
                for j in range(start, len(self.cells)):  # the products the held ones owe
                    self.products(j, self.grad(j), held)
                del held  # before the next block's gradients

    def products(self, j: int, g: Leaves, held: list[tuple[int, Leaves]]) -> None:
        """Cell ``j``'s products with the held cells (itself among them, when held)."""
        for c, h in held:
            self.gram[j, c] = self.gram[c, j] = dot(g, h)

    def grad(self, c: int) -> Leaves:
        """Cell ``c``'s gradient; at its first computation, its products with the targets."""
        give_back_freed_memory()  # the last gradient's, before the next is computed
        g = [np.asarray(leaf) for leaf in self.cell_grad(*(int(i) for i in self.cells[c]))]
        self.passes += 1
        if self.passes == 1:
            cell_bytes = sum(leaf.nbytes for leaf in g)
            self.held_at_once = max(1, min(len(self.cells), CELL_MEMORY // max(cell_bytes, 1)))
            self.bar.total = _passes(len(self.cells), self.held_at_once)
        if c == self.seen:
            self.to_targets[:, c] = [dot(g, target) for target in self.targets]
            self.seen += 1
        self.bar.update()
        return g


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def give_back_freed_memory() -> None:
    """Hands the memory that freed arrays left in the allocator back to the system.

    A gradient of hundreds of megabytes, freed, stays in glibc's heap and counts
    in the process's resident memory until ``malloc_trim``; between two
    gradients that is the difference between holding two and three of them.
    A no-op where the C library has no ``malloc_trim``.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


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
