"""The batch against the batch axis: every leaf with one value per row must be split over it.

With ``axis_name`` the loss runs per device, on the device's rows. A batch, or
one leaf of it, that is not split over the axis (a numpy batch or
``device_put(batch, P())`` under ``jit``; ``in_specs=P()`` under ``shard_map``)
hands every device all its rows: each device computes on them, the window's
items are counted once per device, and the compute is as many times larger.
Nothing would fail: with the whole batch replicated the update is still right,
by the symmetry of identical copies, while ``window_items`` reads R times the
truth; with one leaf replicated (a per-row count, a mask) the update is wrong
too. So both are refused.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from jaxaccum import _sharding
from jaxaccum._sharding import AxisName, Placement


class Caller(NamedTuple):
    """Who checks: its name, what its batch argument is called, the axis of a leaf that
    counts rows, the fix under ``jit``, and the route for a batch every device holds whole."""

    name: str
    argument: str
    row_axis: int
    put: str
    whole: str


VALUE_AND_GRAD = Caller(
    "jaxaccum.value_and_grad",
    "args",
    0,
    "jax.device_put(batch, P({}))",
    "build multi_steps without axis_name and take the gradient with jax.value_and_grad",
)
ACCUMULATE = Caller(
    "jaxaccum.accumulate_gradients",
    "microbatches",
    1,
    "jax.device_put(microbatches, P(None, {}))",
    "call accumulate_gradients without axis_name",
)


def batch_split(args: Any, axis_name: AxisName | None, caller: Caller = VALUE_AND_GRAD) -> None:
    """Refuses a batch whose leaves with one value per row are not all split over the axes.

    The rows are a leaf's leading axis (``caller.row_axis``: 0, or 1 after the
    micro-batches' axis). Under ``jit`` on an Explicit mesh a leaf is split as its
    sharding says for its axes up to the rows; a split of a later one (the
    sequence's) leaves every device a slice of every row and is refused (a
    time-major ``[T, rows]`` batch puts its rows first). Inside ``shard_map`` a leaf
    is split over the axes JAX tracks it varying over (not under ``pmap``,
    which maps a leading axis, or with ``check_vma=False``). A leaf not split over
    every batch axis is refused when no leaf is, or when it has as many rows
    (``caller.row_axis``) as a split leaf (keys too: a key per row is split as
    the rows are). Scalars are not rows;
    with no array argument (a loss that closes over its batch) nothing is told.
    """
    if axis_name is None or _devices(_sharding.axes(axis_name)) in (0, 1):
        return
    where = _sharding.placement(axis_name)
    if where is Placement.PER_DEVICE and not _varying_tracked(axis_name):
        return
    if where not in (Placement.EXPLICIT, Placement.PER_DEVICE):
        return
    leaves = [
        (caller.argument + jax.tree_util.keystr(path), x)
        for path, x in jax.tree_util.tree_flatten_with_path(args)[0]
        if np.ndim(x) > caller.row_axis
    ]
    batch_axes = set(_sharding.axes(axis_name))
    split = {path: _split_over(x, where, caller.row_axis) & batch_axes for path, x in leaves}
    within_rows = lambda x: _split_within_rows(x, where, caller.row_axis) & batch_axes
    sliced = {path: bool(within_rows(x)) for path, x in leaves}  # a row's tokens split
    unsplit = [path for path, x in leaves if split[path] != batch_axes]
    layouts = {path: _layout(x, split[path], where) for path, x in leaves}
    refuse = lambda paths: _not_split(
        caller, axis_name, paths, layouts, where, any(sliced[p] for p in paths)
    )
    if len(unsplit) == len(leaves) and leaves:
        raise ValueError(refuse(unsplit))
    counts = {path: _rows(x, split[path], where, caller.row_axis) for path, x in leaves}
    rows = {counts[path] for path, _ in leaves if split[path]}  # the split leaves' rows
    with_rows = [path for path in unsplit if counts[path] in rows]
    if with_rows:
        raise ValueError(refuse(with_rows))


def _devices(axes: Any) -> int:
    """Devices along mesh axes ``axes`` in the mesh in context; 0 when one is not known
    (pmap, vmap lanes)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(axes) <= set(mesh.axis_names):
        return 0
    return int(np.prod([mesh.shape[a] for a in axes]))


def _split_over(x: Any, where: Placement, row_axis: int) -> set[str]:
    """The mesh axes that split ``x``'s rows: under jit, those its sharding names for its
    axes up to the row axis (stacked micro-batches: the micro-batches' or the rows'); per
    device, what it varies over (``in_specs`` name the axis themselves)."""
    if where is Placement.PER_DEVICE:
        return set(_sharding.varying_axes(x))
    return _mesh_axes(_sharding.spec_of(x).partitions[: row_axis + 1])


def _split_within_rows(x: Any, where: Placement, row_axis: int) -> set[str]:
    """Under jit, the mesh axes that split ``x`` after its row axis (its sequence, say)."""
    if where is Placement.PER_DEVICE:
        return set()
    return _mesh_axes(_sharding.spec_of(x).partitions[row_axis + 1 :])


def _mesh_axes(partitions: Any) -> set[str]:
    return {a for p in partitions if p is not None for a in (p if isinstance(p, tuple) else (p,))}


def _layout(x: Any, split: set[str], where: Placement) -> str:
    """How a leaf is laid out, for the error: its rows' axes, and under jit its sharding."""
    if where is Placement.PER_DEVICE:
        return f"varying over {sorted(split) or 'nothing'}"
    return f"rows split over {sorted(split) or 'nothing'} (sharding {_sharding.spec_of(x)})"


def _rows(x: Any, split: set[str], where: Placement, row_axis: int) -> int:
    """A leaf's number of rows over all devices: its shape's under jit; per device, its
    block's rows times the devices it is split over."""
    rows = int(np.shape(x)[row_axis])
    return rows * _devices(sorted(split)) if where is Placement.PER_DEVICE and split else rows


def _varying_tracked(axis_name: AxisName) -> bool:
    """Whether JAX tracks what varies over the axis here (``shard_map`` with vma)."""
    try:
        index = jax.lax.axis_index(axis_name)
    except NameError:  # not bound: outside any mapping
        return False
    return set(_sharding.axes(axis_name)) <= _sharding.varying_axes(index)


def _not_split(
    caller: Caller, axis_name, paths: list[str], layouts: dict, where, sliced: bool = False
) -> str:
    batch_axes = _sharding.axes(axis_name)
    axes = ", ".join(repr(a) for a in batch_axes)
    leaves = ", ".join(f"{p} {layouts[p]}" for p in paths[:4])
    fix = caller.put if where is Placement.EXPLICIT else "in_specs=P({}) for it in jax.shard_map"
    if where is Placement.EXPLICIT and jax.process_count() > 1:  # device_put keeps one's rows
        fix = (
            "on several processes, from each process's own rows,"
            " jax.make_array_from_process_local_data(jax.NamedSharding(mesh, P({})), local_rows)"
        )
    whole = len(paths) == len(layouts)
    if sliced:  # split over an axis after the rows
        consequence = (
            "Every device would hold a slice of every row instead of rows of its own: for a"
            " loss that looks across a row (a shift of its tokens, attention) the window's"
            " items and the update would be wrong. The rows are "
            + ("the leading axis" if caller.row_axis == 0 else "the axis after the micro-batches'")
            + " (a time-major batch puts them first)"
        )
    elif whole:
        consequence = (
            f"Every device would run on all the batch's rows: the window's items would be"
            f" counted {_devices(batch_axes)} times, the compute as many times larger"
        )
    else:
        consequence = (
            f"Every device would count all their rows ({_devices(batch_axes)} times in all):"
            " the window's items and the update would be wrong"
        )
    if sliced:
        other_way = ""
    elif whole:
        other_way = (
            f" For a batch that every device holds whole, {caller.whole} (GSPMD: its items"
            " counted once, the gradient reduced on every micro-step)."
        )
    else:
        other_way = (
            " A leaf that is not one value per row (a table every device needs whole) goes"
            " outside the arguments: close over it."
        )
    return (
        f"{caller.name}: {'the batch is' if whole else 'leaves of the batch are'} not split"
        f" over the batch axis {axes} of axis_name={axis_name!r} ({leaves}). {consequence}."
        f" Split the rows over the axis: {fix.format(axes)}.{other_way}"
    )
