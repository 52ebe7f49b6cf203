"""Where the window sums live between boundaries, and how they are reduced.

``axis_name`` always names the mesh axis the batch is split over. Under
``shard_map`` or ``pmap`` each device holds its own window sums (a leading
axis of length 1 per device, so that the global state stacks one row per
device) and the boundary adds them with one ``psum``. Without an
``axis_name`` the sums are whatever the gradients are (global sums under
``jit`` on sharded arrays) and nothing is reduced.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxaccum._state import WINDOW_SUMS, MultiStepsState

AxisName = str | tuple[str, ...]


def _axes(axis_name: AxisName) -> tuple[str, ...]:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def varying_axes(x: Any) -> frozenset[str]:
    """The ``shard_map`` axes over which ``x`` differs (empty outside, or under pmap)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def check_axis_bound(axis_name: AxisName) -> None:
    for name in _axes(axis_name):
        try:
            jax.lax.axis_size(name)
        except NameError:
            raise NameError(
                f"multi_steps: axis_name {name!r} is not bound here: call update inside"
                " jax.pmap(..., axis_name=...) or jax.shard_map over a mesh with that"
                " axis, or build multi_steps without axis_name."
            ) from None


def check_per_device_grads(grads: Any, axis_name: AxisName) -> None:
    """Rejects gradients that JAX's autodiff already summed over the devices.

    Inside ``shard_map`` with vma checking (the default), the gradient with
    respect to replicated parameters of a per-device loss is summed over the
    axis by autodiff: a collective on every micro-step, and the boundary's
    ``psum`` would then count every device ``R`` times, whatever ``num_items``
    is. Such a leaf does not vary over the axis. Whether vma checking is on is
    the type of ``axis_index``; without it (``check_vma=False``, ``pmap``)
    autodiff does not sum, and there is nothing to reject.
    """
    axes = frozenset(_axes(axis_name))
    if not axes <= varying_axes(jax.lax.axis_index(axis_name)):
        return
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        if not axes <= varying_axes(g):
            raise ValueError(
                f"multi_steps.update: `grads` leaf {jax.tree_util.keystr(path)} is already"
                f" summed over {sorted(axes)} (it does not vary over the axis): the window's"
                f" sum would count every device {jax.lax.axis_size(axis_name)} times."
                " Inside shard_map, take per-device gradients:"
                f" jaxaccum.value_and_grad(loss_fn, axis_name={axis_name!r}) differentiates"
                f" with respect to jax.lax.pcast(params, {axis_name!r}, to='varying'); the"
                " window's single psum happens at the boundary."
            )


def to_stored(x: jax.Array, axis_name: AxisName | None) -> jax.Array:
    """A window sum in its stored layout (a leading device axis with an axis name)."""
    return x if axis_name is None else x[None]


def from_stored(x: jax.Array, axis_name: AxisName | None) -> jax.Array:
    return x if axis_name is None else x[0]


def reduce_over_devices(sums: Any, axis_name: AxisName | None) -> Any:
    """The window's one collective: every device's sums added, in one ``psum``."""
    return sums if axis_name is None else jax.lax.psum(sums, axis_name)


def partition_specs(opt_state: Any, axis_name: AxisName) -> Any:
    """``PartitionSpec``\\ s of an optimizer state for ``jax.shard_map``.

    Between boundaries the window sums differ from device to device, so they
    must not be declared replicated. With ``multi_steps(..., axis_name=...)``
    each window-sum leaf (``grad_sum``, ``loss_sum``, ``num_items``) holds a
    leading axis of length 1; this function gives those leaves
    ``P(axis_name)`` (the global array stacks one row per device) and every
    other leaf ``P()`` (replicated: the inner state, the counters, the record).

    Args:
      opt_state: an optimizer state (or its ``jax.eval_shape``) containing one
        or more :class:`MultiStepsState`.
      axis_name: the mesh axis the batch is split over.

    Returns:
      A pytree of ``PartitionSpec`` with the structure of ``opt_state``.

    Example:
      >>> import jax, optax, jaxaccum
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ('data',))
      >>> tx = jaxaccum.multi_steps(optax.sgd(0.1), 2, axis_name='data')
      >>> params = {'w': jax.numpy.zeros(3)}
      >>> specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, params), 'data')
      >>> state = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)
      >>> state.grad_sum['w'].shape  # one row per device
      (1, 3)
    """

    def specs_of(node: Any) -> Any:
        if not isinstance(node, MultiStepsState):
            return P()
        replicated = jax.tree.map(lambda _: P(), node)
        per_device = {
            name: jax.tree.map(lambda _: P(axis_name), getattr(node, name)) for name in WINDOW_SUMS
        }
        return replicated._replace(**per_device)

    return jax.tree.map(specs_of, opt_state, is_leaf=lambda x: isinstance(x, MultiStepsState))
