"""Where the window sums live between boundaries, and the one reduction of them.

``axis_name`` names the mesh axis the batch is split over; the axis's type
where ``update`` runs decides the :class:`Placement` of the sums:

* ``EXPLICIT``, ``jax.jit`` on an Explicit mesh: one row per device,
  ``P(axis, *param_spec)``; a row goes in and out as an ``unreduced`` partial
  sum without a collective, and the boundary's ``jax.reshard`` is the
  all-reduce. A parameter sharded over the axis (FSDP) keeps its sum sharded
  like itself;
* ``PER_DEVICE``, ``jax.shard_map`` or ``jax.pmap``: each device's own sums with
  a leading axis of length 1; the boundary ``psum``-s them;
* ``GLOBAL``, no ``axis_name``: the sums are global already, nothing to reduce.

The routes and their communication: ``docs/data-parallel.md``.
"""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

AxisName = str | tuple[str, ...]


class Placement(enum.Enum):
    """Where the window sums are held between boundaries (module docstring)."""

    GLOBAL = "global"
    PER_DEVICE = "per_device"
    EXPLICIT = "explicit"


def axes(axis_name: AxisName) -> tuple[str, ...]:
    """``axis_name`` as a tuple of mesh axis names."""
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def placement(axis_name: AxisName | None) -> Placement:
    """The :class:`Placement` of the window sums where this runs (the mesh in context)."""
    if axis_name is None:
        return Placement.GLOBAL
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and all(a in mesh.axis_names for a in axes(axis_name)):
        types = {mesh.axis_types[mesh.axis_names.index(a)] for a in axes(axis_name)}
        if types == {AxisType.Manual}:
            return Placement.PER_DEVICE
        if types == {AxisType.Explicit}:
            return Placement.EXPLICIT
        raise ValueError(
            f"axis_name: mesh axis {axis_name!r} is of type {sorted(t.name for t in types)}:"
            " under jax.jit an Auto axis leaves the window's sums to the partitioner, which"
            " reduces every micro-step. For one gradient reduction per window make the axis"
            " Explicit (jax.make_mesh's default), or map the step with jax.shard_map; for GSPMD's"
            " per-micro-step reduction pass no axis_name (to multi_steps and value_and_grad)."
        )
    return Placement.PER_DEVICE  # pmap or vmap, or outside any mapping (shard_map's layout)


def rebuild(spec: P, *, unreduced: frozenset | None = None, reduced: frozenset | None = None) -> P:
    """``spec`` with other unreduced / reduced axes (the same on jax 0.10 and 0.12)."""
    return P(
        *spec.partitions,
        unreduced=spec.unreduced if unreduced is None else unreduced,
        reduced=spec.reduced if reduced is None else reduced,
    )


def uses(spec: P, axis_name: AxisName) -> bool:
    """Whether ``spec`` shards an array dimension over (one of) the axes."""
    used = {
        a for p in spec.partitions if p is not None for a in (p if isinstance(p, tuple) else (p,))
    }
    return bool(used & set(axes(axis_name)))


def unreduced_spec(param: Any, axis_name: AxisName) -> P:
    """An in-step gradient sum of ``param`` under jit: unreduced over the axis, else like
    ``param`` (FSDP: a gradient reduced onto the parameter's shards)."""
    spec = spec_of(param)
    return spec if uses(spec, axis_name) else rebuild(spec, unreduced=frozenset(axes(axis_name)))


def row_spec(spec: P, axis_name: AxisName) -> P:
    """One row per device: a leading axis sharded over the batch axis, then ``spec``."""
    return P(axis_name, *spec.partitions)


def devices_along(axis_name: AxisName) -> int:
    """The number of devices along the batch axis (or axes) of the mesh in context."""
    mesh = jax.sharding.get_abstract_mesh()
    return int(np.prod([mesh.shape[a] for a in axes(axis_name)]))


def zero_sum(param: Any, dtype: Any, axis_name: AxisName | None, where: Placement) -> jax.Array:
    """A window sum of zeros in its stored layout (module docstring)."""
    zeros = jnp.zeros(jnp.shape(param), dtype)
    if where is Placement.PER_DEVICE:
        return zeros[None]
    if where is Placement.EXPLICIT:
        spec = spec_of(param)
        if uses(spec, axis_name):  # FSDP: kept like the parameter
            return jax.reshard(zeros, spec)
        rows = jnp.zeros((devices_along(axis_name), *jnp.shape(param)), dtype)
        return jax.reshard(rows, row_spec(spec, axis_name))
    return zeros


def zero_sums(
    params: Any, dtype: Any, items_dtype: Any, axis_name: AxisName | None, where: Placement
) -> dict:
    """The three window sums of a fresh state: ``grad_sum``, ``loss_sum``, ``num_items``."""
    zero = jnp.zeros((), items_dtype)
    return dict(
        grad_sum=jax.tree.map(lambda p: zero_sum(p, dtype, axis_name, where), params),
        loss_sum=zero_sum(zero, items_dtype, axis_name, where),
        num_items=zero_sum(zero, items_dtype, axis_name, where),
    )


def replicated(tree: Any, where: Placement) -> Any:
    """Under jit on an Explicit mesh, ``tree``'s leaves declared replicated (``P()``).

    jax 0.12.0.1 merges a jitted ``init``'s identical zeros, and the replicated
    record then comes out labelled with the sums' sharding; an explicit
    replicated sharding keeps them apart.
    """
    if where is not Placement.EXPLICIT:
        return tree
    return jax.tree.map(lambda x: jax.reshard(x, P(*(None,) * jnp.ndim(x))), tree)


def to_stored(
    x: jax.Array, window_sum: jax.Array, axis_name: AxisName | None, where: Placement
) -> jax.Array:
    """This call's value (a gradient leaf, or a scalar) in its window sum's dtype and layout."""
    x = jnp.asarray(x).astype(window_sum.dtype)
    if where is Placement.PER_DEVICE:
        return x[None]
    if where is Placement.EXPLICIT and window_sum.ndim == x.ndim + 1:
        return _into_rows(x, axis_name)
    return x


def from_stored(
    window_sum: jax.Array, ndim: int, axis_name: AxisName | None, where: Placement
) -> jax.Array:
    """A window sum as this device's partial sum of an ``ndim``-dimensional value."""
    if where is Placement.PER_DEVICE:
        return window_sum[0]
    if where is Placement.EXPLICIT and window_sum.ndim == ndim + 1:
        return _out_of_rows(window_sum, axis_name)
    return window_sum


def _into_rows(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """A partial sum (unreduced over the axis) or a global value as one row per device.

    Local, no collective: each device writes its block into its own row; a value
    that is the same on every device is written into the first row only, so that
    the rows still add up to it. ``check_vma=False``: JAX has no cast from
    unreduced to varying, and the block of an unreduced array on a device is that
    device's partial sum, which is exactly what its row holds.
    """
    spec = spec_of(x)
    partial = set(axes(axis_name)) <= spec.unreduced

    def write(block):
        if not partial:
            first = jax.lax.axis_index(axis_name) == 0
            block = jnp.where(first, block, jnp.zeros_like(block))
        return block[None]

    out = row_spec(spec, axis_name)
    return jax.shard_map(write, in_specs=spec, out_specs=out, check_vma=False)(x)


def _out_of_rows(rows: jax.Array, axis_name: AxisName) -> jax.Array:
    """Each device's row back as its partial sum, an ``unreduced`` array (local)."""
    spec = spec_of(rows)
    out = rebuild(P(*spec.partitions[1:]), unreduced=frozenset(axes(axis_name)))
    if rows.shape[0] == 1:  # one device: jax 0.10.2 cannot lower this shard_map there
        return jax.reshard(rows[0], out)
    read = lambda block: jax.lax.pcast(block[0], axis_name, to="unreduced")
    return jax.shard_map(read, in_specs=spec, out_specs=out)(rows)


def _named_spec(x: Any) -> P | None:
    """``x``'s spec when it carries an explicit sharding, else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
        return sharding.spec
    return None


def spec_of(x: Any) -> P:
    """``x``'s PartitionSpec in explicit mode (``P()``: replicated, or no mesh)."""
    spec = _named_spec(x)
    return P() if spec is None else spec


def reduced_zeros(window_sum: jax.Array, dtype: Any) -> jax.Array:
    """Zeros shaped and sharded like a window sum once reduced (the updates' slot)."""
    spec = _named_spec(window_sum)
    zeros = jnp.zeros(window_sum.shape, dtype)
    if spec is None:
        return zeros
    return jax.reshard(zeros, rebuild(spec, unreduced=frozenset()))


def updates_slot(
    grads: Any, grad_sum: Any, update_types: Any, axis_name: AxisName | None, where: Placement
) -> Any:
    """The loop carry that receives the window's updates (zero between boundaries).

    The inner optimizer's update dtypes, the parameters' shardings. On one
    device it starts as this call's gradient, a buffer that is dead once added
    to the sum, so XLA reuses it instead of writing zeros. Under ``shard_map``
    a block of a parameter sharded over another axis varies over that axis.
    """

    def slot(g, window_sum, u):
        if where is Placement.GLOBAL and jnp.shape(g) == u.shape:
            return g.astype(u.dtype)
        if where is Placement.EXPLICIT:  # the gradient's sharding without its unreduced axes
            return reduced_zeros(g, u.dtype)
        zeros = reduced_zeros(from_stored(window_sum, jnp.ndim(g), None, where), u.dtype)
        blocks = varying_axes(g) - (frozenset(axes(axis_name)) if axis_name else frozenset())
        return jax.lax.pcast(zeros, tuple(sorted(blocks)), to="varying") if blocks else zeros

    return jax.tree.map(slot, grads, grad_sum, update_types)


def like(x: jax.Array, target: jax.Array) -> jax.Array:
    """``x`` resharded to ``target``'s explicit sharding (a no-op when they agree)."""
    spec = _named_spec(target)
    return x if spec is None or _named_spec(x) == spec else jax.reshard(x, spec)


def reduce_over_devices(sums: Any, axis_name: AxisName | None) -> Any:
    """The window's one collective: every device's sums added.

    Per device: one ``psum`` of the whole tuple. Unreduced: each unreduced leaf
    resharded to its sharding without the axis (an all-reduce; leaves that are
    already global, such as the loss and item sums under ``jit``, stay).
    """
    where = placement(axis_name)
    if where is Placement.GLOBAL:
        return sums
    if where is Placement.PER_DEVICE:
        return jax.lax.psum(sums, axis_name)

    def reduce(x):
        spec = spec_of(x)
        if not spec.unreduced & set(axes(axis_name)):
            return x
        return jax.reshard(x, rebuild(spec, unreduced=spec.unreduced - set(axes(axis_name))))

    return jax.tree.map(reduce, sums)


def global_norm(grads: Any) -> jax.Array:
    """The L2 norm over the whole parameters, wherever their blocks are.

    Under ``shard_map`` a leaf sharded over another mesh axis (tensor
    parallelism over "model") holds one block per device there: its squared
    norm varies over that axis and is added over it (a scalar ``psum``). Leaves
    that do not vary, and every leaf outside ``shard_map``, are what they are.
    """

    def squared(g):
        total = jnp.sum(jnp.square(g))
        blocks = tuple(sorted(varying_axes(total)))
        return jax.lax.psum(total, blocks) if blocks else total

    return jnp.sqrt(optax.tree.sum(jax.tree.map(squared, grads)))


def varying_axes(x: Any) -> frozenset[str]:
    """The ``shard_map`` axes over which ``x`` (or its aval) differs (empty outside, pmap)."""
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def arrival_spec(window_sum: jax.Array, ndim: int, axis_name: AxisName) -> P:
    """Under jit: the spec a gradient must have to join ``window_sum`` with no collective."""
    spec = spec_of(window_sum)
    if window_sum.ndim == ndim + 1:  # rows: a partial sum, unreduced over the axis
        return rebuild(P(*spec.partitions[1:]), unreduced=frozenset(axes(axis_name)))
    return spec  # FSDP: sharded like the parameter
