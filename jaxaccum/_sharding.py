"""Where the window sums live between boundaries, and how they are reduced once.

``axis_name`` always names the mesh axis the batch is split over. One code
path, three ways to run it, told apart by the axis's type where ``update``
runs:

* ``jax.jit`` on a mesh whose axis is Explicit (``jax.make_mesh``'s default):
  the gradient with respect to parameters cast to ``reduced`` comes out
  ``unreduced`` (each device holds a partial sum). The state keeps each
  device's partial sums as its own row of an ordinary array sharded over the
  axis (``P(axis, *param_spec)``: one row per device, the same global layout as
  under ``shard_map``), so Orbax and ``jax.device_get`` read it like any array.
  Moving a partial sum into its row, and a row back to an ``unreduced`` value at
  the boundary, are local; the boundary's ``jax.reshard`` to the parameters'
  sharding is the one all-reduce (:attr:`Layout.EXPLICIT`);
* ``jax.shard_map`` (a Manual axis) or ``jax.pmap``: each device holds its own
  sums, with a leading axis of length 1 (one row per device in the global
  array, :func:`partition_specs`), and the boundary ``psum``-s them
  (:attr:`Layout.PER_DEVICE`);
* no ``axis_name``: the sums are what the gradients are (global sums under
  ``jit`` on sharded arrays, where the partitioner reduces every micro-step's
  gradient) and nothing is reduced (:attr:`Layout.GLOBAL`).

A parameter sharded over the batch axis (FSDP) is the exception under
``jit``: its gradient arrives reduced onto its shards, and its sum is kept
sharded like the parameter (rows would hold the whole gradient per device).
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


class Layout(enum.Enum):
    """How the window sums are held between boundaries (module docstring)."""

    GLOBAL = "global"
    PER_DEVICE = "per_device"
    EXPLICIT = "explicit"


def axes(axis_name: AxisName) -> tuple[str, ...]:
    """``axis_name`` as a tuple of mesh axis names."""
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def layout(axis_name: AxisName | None) -> Layout:
    """The :class:`Layout` of the window sums where this runs (the mesh in context)."""
    if axis_name is None:
        return Layout.GLOBAL
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and all(a in mesh.axis_names for a in axes(axis_name)):
        types = {mesh.axis_types[mesh.axis_names.index(a)] for a in axes(axis_name)}
        if types == {AxisType.Manual}:
            return Layout.PER_DEVICE
        if types == {AxisType.Explicit}:
            return Layout.EXPLICIT
        raise ValueError(
            f"multi_steps: mesh axis {axis_name!r} is of type {sorted(t.name for t in types)}:"
            " under jax.jit an Auto axis leaves the window's sums to the partitioner, which"
            " reduces every micro-step. For one gradient reduction per window make the axis"
            " Explicit (jax.make_mesh's default), or map the step with jax.shard_map; for"
            " GSPMD's per-micro-step reduction build multi_steps without axis_name."
        )
    return Layout.PER_DEVICE  # pmap or vmap, or outside any mapping (shard_map's layout)


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


def _reshard(x: jax.Array, spec: P) -> jax.Array:
    return jax.reshard(x, spec)


def unreduced_spec(param: Any, axis_name: AxisName) -> P:
    """An in-step gradient sum of ``param`` under jit: unreduced over the axis, else like
    ``param`` (FSDP: a gradient reduced onto the parameter's shards)."""
    spec = spec_of(param)
    return spec if uses(spec, axis_name) else rebuild(spec, unreduced=frozenset(axes(axis_name)))


def row_spec(spec: P, axis_name: AxisName) -> P:
    """One row per device: a leading axis sharded over the batch axis, then ``spec``."""
    return P(axis_name, *spec.partitions)


def _devices_along(axis_name: AxisName) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return int(np.prod([mesh.shape[a] for a in axes(axis_name)]))


def zero_sum(param: Any, dtype: Any, axis_name: AxisName | None, where: Layout) -> jax.Array:
    """A window sum of zeros in its stored layout (module docstring)."""
    zeros = jnp.zeros(jnp.shape(param), dtype)
    if where is Layout.PER_DEVICE:
        return zeros[None]
    if where is Layout.EXPLICIT:
        spec = spec_of(param)
        if uses(spec, axis_name):  # FSDP: kept like the parameter
            return _reshard(zeros, spec)
        rows = jnp.zeros((_devices_along(axis_name), *jnp.shape(param)), dtype)
        return _reshard(rows, row_spec(spec, axis_name))
    return zeros


def zero_sums(params: Any, dtype: Any, items_dtype: Any, axis_name: AxisName | None,
              where: Layout) -> dict:  # fmt: skip
    """The three window sums of a fresh state: ``grad_sum``, ``loss_sum``, ``num_items``."""
    zero = jnp.zeros((), items_dtype)
    return dict(
        grad_sum=jax.tree.map(lambda p: zero_sum(p, dtype, axis_name, where), params),
        loss_sum=zero_sum(zero, items_dtype, axis_name, where),
        num_items=zero_sum(zero, items_dtype, axis_name, where),
    )


def replicated(tree: Any, where: Layout) -> Any:
    """Under jit on an Explicit mesh, ``tree``'s leaves declared replicated (``P()``).

    jax 0.12.0.1 merges a jitted ``init``'s identical zeros, and the replicated
    record then comes out labelled with the sums' sharding; an explicit
    replicated sharding keeps them apart.
    """
    if where is not Layout.EXPLICIT:
        return tree
    return jax.tree.map(lambda x: jax.reshard(x, P(*(None,) * jnp.ndim(x))), tree)


def to_stored(x: jax.Array, window_sum: jax.Array, axis_name: AxisName | None,
              where: Layout) -> jax.Array:  # fmt: skip
    """This call's value (a gradient leaf, or a scalar) in its window sum's dtype and layout."""
    x = jnp.asarray(x).astype(window_sum.dtype)
    if where is Layout.PER_DEVICE:
        return x[None]
    if where is Layout.EXPLICIT and window_sum.ndim == x.ndim + 1:
        return _into_rows(x, axis_name)
    return x


def from_stored(window_sum: jax.Array, ndim: int, axis_name: AxisName | None,
                where: Layout) -> jax.Array:  # fmt: skip
    """A window sum as this device's partial sum of an ``ndim``-dimensional value."""
    if where is Layout.PER_DEVICE:
        return window_sum[0]
    if where is Layout.EXPLICIT and window_sum.ndim == ndim + 1:
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
        return _reshard(rows[0], out)
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
    return _reshard(zeros, rebuild(spec, unreduced=frozenset()))


def updates_slot(grads: Any, grad_sum: Any, update_types: Any, axis_name: AxisName | None,
                 where: Layout) -> Any:  # fmt: skip
    """The loop carry that receives the window's updates (zero between boundaries).

    The inner optimizer's update dtypes, the parameters' shardings. On one
    device it starts as this call's gradient, a buffer that is dead once added
    to the sum, so XLA reuses it instead of writing zeros. Under ``shard_map``
    a block of a parameter sharded over another axis varies over that axis.
    """

    def slot(g, window_sum, u):
        if where is Layout.GLOBAL and jnp.shape(g) == u.shape:
            return g.astype(u.dtype)
        if where is Layout.EXPLICIT:  # the gradient's sharding without its unreduced axes
            return reduced_zeros(g, u.dtype)
        zeros = reduced_zeros(from_stored(window_sum, jnp.ndim(g), None, where), u.dtype)
        blocks = varying_axes(g) - (frozenset(axes(axis_name)) if axis_name else frozenset())
        return jax.lax.pcast(zeros, tuple(sorted(blocks)), to="varying") if blocks else zeros

    return jax.tree.map(slot, grads, grad_sum, update_types)


def like(x: jax.Array, target: jax.Array) -> jax.Array:
    """``x`` resharded to ``target``'s explicit sharding (a no-op when they agree)."""
    spec = _named_spec(target)
    return x if spec is None or _named_spec(x) == spec else _reshard(x, spec)


def reduce_over_devices(sums: Any, axis_name: AxisName | None) -> Any:
    """The window's one collective: every device's sums added.

    Per device: one ``psum`` of the whole tuple. Unreduced: each unreduced leaf
    resharded to its sharding without the axis (an all-reduce; leaves that are
    already global, such as the loss and item sums under ``jit``, stay).
    """
    where = layout(axis_name)
    if where is Layout.GLOBAL:
        return sums
    if where is Layout.PER_DEVICE:
        return jax.lax.psum(sums, axis_name)

    def reduce(x):
        spec = spec_of(x)
        if not spec.unreduced & set(axes(axis_name)):
            return x
        return _reshard(x, rebuild(spec, unreduced=spec.unreduced - set(axes(axis_name))))

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


def vma_checked(axis_name: AxisName) -> bool:
    """Under ``shard_map``: whether JAX tracks which values vary over the axis."""
    return frozenset(axes(axis_name)) <= varying_axes(jax.lax.axis_index(axis_name))


def other_manual_axes(axis_name: AxisName) -> list[str]:
    """Manual mesh axes of more than one device other than the batch axes."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return []
    return [
        a
        for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == AxisType.Manual and a not in axes(axis_name) and mesh.shape[a] > 1
    ]


def varying_axes(x: Any) -> frozenset[str]:
    """The ``shard_map`` axes over which ``x`` differs (empty outside, or under pmap)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def check_axis_bound(axis_name: AxisName) -> None:
    for name in axes(axis_name):
        try:
            jax.lax.axis_size(name)
        except NameError:
            raise NameError(
                f"multi_steps: axis_name {name!r} is not bound here: call update inside"
                " jax.jit on a mesh with that axis (jax.set_mesh), jax.shard_map over it or"
                " jax.pmap(..., axis_name=...), or build multi_steps without axis_name."
            ) from None


def check_grads(grads: Any, grad_sum: Any, axis_name: AxisName, where: Layout) -> None:
    """Refuses gradients that were already summed over the devices.

    Per device (``shard_map`` with vma checking, the default): the gradient with
    respect to replicated parameters of a per-device loss is summed over the
    axis by autodiff, on every micro-step, and the boundary's ``psum`` would then
    count every device ``R`` times whatever ``num_items`` is. Such a leaf does
    not vary over the axis. Whether vma checking is on is the type of
    ``axis_index``; without it (``check_vma=False``, ``pmap``) autodiff does not
    sum. Unreduced (``jit``): a replicated gradient was all-reduced this
    micro-step (k reductions per window), and adding it to an unreduced sum
    is refused by JAX; each leaf must be unreduced, or sharded like its sum.
    """
    batch_axes = frozenset(axes(axis_name))
    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    if where is Layout.PER_DEVICE:
        if not batch_axes <= varying_axes(jax.lax.axis_index(axis_name)):
            return
        for path, g in leaves:
            if not batch_axes <= varying_axes(g):
                raise ValueError(
                    f"multi_steps.update: `grads` leaf {jax.tree_util.keystr(path)} is already"
                    f" summed over {sorted(batch_axes)} (it does not vary over the axis): the window's"
                    f" sum would count every device {jax.lax.axis_size(axis_name)} times."
                    " Inside shard_map, take per-device gradients:"
                    f" jaxaccum.value_and_grad(loss_fn, axis_name={axis_name!r}) differentiates"
                    f" with respect to jax.lax.pcast(params, {axis_name!r}, to='varying'); the"
                    " window's single psum happens at the boundary."
                )
    elif where is Layout.EXPLICIT:
        for (path, g), s in zip(leaves, jax.tree.leaves(grad_sum), strict=True):
            if not _same_spec(spec_of(g), arrival_spec(s, jnp.ndim(g), axis_name), jnp.ndim(g)):
                raise ValueError(
                    f"multi_steps.update: `grads` leaf {jax.tree_util.keystr(path)} has type"
                    f" {jax.typeof(g)}; to join its window sum with no collective it must be"
                    f" {_spec_words(arrival_spec(s, jnp.ndim(g), axis_name))}. Under jax.jit on an"
                    " Explicit mesh, take the gradients with"
                    f" jaxaccum.value_and_grad(loss_fn, axis_name={axis_name!r}): it keeps each"
                    " device's gradient a partial sum (unreduced, no all-reduce per micro-step);"
                    " and make the state with tx.init under the same mesh. A replicated gradient"
                    " was all-reduced already: for that (GSPMD) path build multi_steps without"
                    " axis_name."
                )


def arrival_spec(window_sum: jax.Array, ndim: int, axis_name: AxisName) -> P:
    """Under jit: the spec a gradient must have to join ``window_sum`` with no collective."""
    spec = spec_of(window_sum)
    if window_sum.ndim == ndim + 1:  # rows: a partial sum, unreduced over the axis
        return rebuild(P(*spec.partitions[1:]), unreduced=frozenset(axes(axis_name)))
    return spec  # FSDP: sharded like the parameter


def _spec_words(spec: P) -> str:
    """A spec in words, the same on every JAX version (their reprs differ)."""
    words = f"split as {tuple(spec.partitions)}"
    return words + (f", unreduced over {sorted(spec.unreduced)}" if spec.unreduced else "")


def _same_spec(a: P, b: P, ndim: int) -> bool:
    pad = lambda spec: tuple(spec.partitions) + (None,) * (ndim - len(spec.partitions))
    return (pad(a), a.unreduced, a.reduced) == (pad(b), b.unreduced, b.reduced)
