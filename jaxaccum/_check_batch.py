"""``value_and_grad``'s inputs against the batch axis: the batch must be split over it.

With ``axis_name`` the loss runs per device, on the device's rows. A batch that
is not split over the axis (a numpy batch or ``device_put(batch, P())`` under
``jit``; ``in_specs=P()`` under ``shard_map``) hands every device the whole
batch: each device computes the same loss, the window's items are counted once
per device, and the compute is as many times larger. Nothing would fail: the
update would still be right, by the symmetry of identical copies, while
``window_items`` reads R times the truth. So it is refused.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxaccum import _sharding
from jaxaccum._sharding import AxisName, Placement
from jaxaccum._streams import is_key


def batch_split(args: tuple, axis_name: AxisName | None) -> None:
    """Refuses arguments none of whose arrays is split over every batch axis.

    Under ``jit`` on an Explicit mesh the arrays' shardings tell; inside
    ``shard_map`` the axes JAX tracks each value as varying over (not under
    ``pmap``, which maps a leading axis, or with ``check_vma=False``). Scalars
    and PRNG keys are not rows; with no array argument at all (a loss that
    closes over its batch) there is nothing to tell.
    """
    if axis_name is None:
        return
    rows = [
        ("args" + jax.tree_util.keystr(path), x)
        for path, x in jax.tree_util.tree_flatten_with_path(args)[0]
        if np.ndim(x) >= 1 and not is_key(x)
    ]
    where = _sharding.placement(axis_name)
    if not rows or where is Placement.GLOBAL or _devices(axis_name) == 1:
        return
    if where is Placement.EXPLICIT:
        found = {path: _sharding.spec_of(x) for path, x in rows}
        split = set().union(*(_split_axes(spec) for spec in found.values()))
    elif _varying_tracked(axis_name):
        found = {path: sorted(_sharding.varying_axes(x)) for path, x in rows}
        split = set().union(*(_sharding.varying_axes(x) for _, x in rows))
    else:
        return
    missing = set(_sharding.axes(axis_name)) - split
    if missing:
        raise ValueError(_not_split(axis_name, sorted(missing), found, where))


def _devices(axis_name: AxisName) -> int:
    """Devices along the batch axes in the mesh in context (1 when none is known)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(_sharding.axes(axis_name)) <= set(mesh.axis_names):
        return 0  # pmap or vmap lanes: not known here
    return int(np.prod([mesh.shape[a] for a in _sharding.axes(axis_name)]))


def _split_axes(spec: jax.sharding.PartitionSpec) -> set[str]:
    """The mesh axes that split some dimension of an array laid out by ``spec``."""
    parts = [p for p in spec.partitions if p is not None]
    return {a for p in parts for a in (p if isinstance(p, tuple) else (p,))}


def _varying_tracked(axis_name: AxisName) -> bool:
    """Whether JAX tracks what varies over the axis here (``shard_map`` with vma)."""
    try:
        index = jax.lax.axis_index(axis_name)
    except NameError:  # not bound: outside any mapping
        return False
    return set(_sharding.axes(axis_name)) <= _sharding.varying_axes(index)


def _not_split(axis_name, missing: list[str], found: dict, where: Placement) -> str:
    devices = _devices(axis_name)
    times = f"{devices} times" if devices else "once per device"
    leaves = ", ".join(f"{path}: {layout}" for path, layout in list(found.items())[:4])
    how, layout = (
        ("jax.device_put(batch, P({}))", "their shardings")
        if where is Placement.EXPLICIT
        else ("in_specs=P({}) for the batch in jax.shard_map", "the axes they vary over")
    )
    axes = ", ".join(repr(a) for a in _sharding.axes(axis_name))
    return (
        f"jaxaccum.value_and_grad: the batch is not split over the batch axis"
        f" {', '.join(map(repr, missing))} of axis_name={axis_name!r} ({layout}: {leaves}). Every device would run the loss on"
        f" the whole batch: the window's items would be counted {times}, and the compute"
        f" would be as many times larger. Split its rows over the axis: {how.format(axes)}."
        " For a batch that every device holds whole, build multi_steps without axis_name and"
        " take the gradient with jax.value_and_grad (GSPMD: its items are counted once, the"
        " gradient reduced on every micro-step)."
    )
