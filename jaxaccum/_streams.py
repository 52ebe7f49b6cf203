"""Randomness per device: each device draws its own stream, as plain ``jit`` draws distinct rows.

``jaxaccum.value_and_grad`` runs the loss per device; a replicated key would
draw the same dropout mask on every device. The typed keys among the loss's
arguments are folded with the device's index (:func:`own_streams`), and a draw
from any other key that is the same on every device is refused
(:func:`draws_checked`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp

from jaxaccum import _sharding
from jaxaccum._sharding import AxisName, Placement


def own_streams(tree: Any, axis_name: AxisName | None) -> Any:
    """Per device, every typed PRNG key in ``tree`` folded with the device's index.

    ``loss_fn`` runs per device (a ``shard_map`` under ``jit``, or yours): a
    replicated key would draw the same dropout mask on every device, where the
    same step under plain ``jit`` draws distinct rows. An array of keys is
    folded key by key; one split over the devices (a key per row, where JAX
    tracks what varies: ``jit`` on a mesh, ``shard_map``) is each device's own
    already and is left as it is, so it draws what it draws on one device
    (under ``pmap`` or ``shard_map(check_vma=False)`` JAX cannot tell it from a
    replicated one: it is folded too, and draws other masks than one device
    would, still distinct per device). Outside a per-device context, or
    without ``axis_name``, ``tree`` is returned as it is.
    """
    index = _device_index(axis_name)
    if index is None:
        return tree
    batch_axes = frozenset(_sharding.axes(axis_name))

    def fold(x):
        if not is_key(x) or batch_axes <= _sharding.varying_axes(x):
            return x  # not a key, or keys split over the devices with the rows already
        return jnp.vectorize(lambda key: jax.random.fold_in(key, index))(x)

    return jax.tree.map(fold, tree)


def draws_checked(fn: Callable[..., Any], axis_name: AxisName | None) -> Callable[..., Any]:
    """``fn``, refusing a random draw from a key that is the same on every device.

    Where ``fn`` runs per device and JAX tracks what varies over the devices
    (``jit`` on a mesh, ``shard_map``), ``fn`` is traced once to a jaxpr (its
    traced arguments as inputs, the others as given), its draws (:data:`DRAWS`)
    are checked, and the jaxpr is evaluated in its place (no second trace of the
    model). A key that ``loss_fn`` closes over, or keeps anywhere but its
    arguments, and a raw ``uint32`` key are not folded by :func:`own_streams`:
    every device would draw the same dropout mask, where plain ``jit`` draws
    distinct rows. Elsewhere (one device, GSPMD, ``pmap``, ``shard_map`` without
    vma checking) ``fn`` is returned as it is.
    """

    def checked(*args: Any) -> Any:
        index = _device_index(axis_name)
        batch_axes = frozenset(_sharding.axes(axis_name or ()))
        if index is None or not batch_axes <= _sharding.varying_axes(index):
            return fn(*args)  # not per device, or JAX does not track what varies
        leaves, tree = jax.tree.flatten(args)
        traced = [i for i, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]

        def of_arrays(*arrays):
            filled = list(leaves)
            for i, x in zip(traced, arrays, strict=True):
                filled[i] = x
            return fn(*tree.unflatten(filled))

        arrays = [leaves[i] for i in traced]
        closed, out_shape = jax.make_jaxpr(of_arrays, return_shape=True)(*arrays)
        _refuse_shared_draws(closed.jaxpr, batch_axes, axis_name)
        out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *arrays)
        return jax.tree.structure(out_shape).unflatten(out)

    return checked


# The primitives that draw random bits, and the positions of their key among their operands.
DRAWS = {"random_bits": (0,), "rng_bit_generator": (0,), "threefry2x32": (0, 1)}


def _refuse_shared_draws(jaxpr: Any, batch_axes: frozenset, axis_name: AxisName) -> None:
    """Raises for a draw (:data:`DRAWS`) in ``jaxpr`` (or a jaxpr inside it) whose key does
    not vary over ``batch_axes``."""
    for eqn in jaxpr.eqns:
        for position in DRAWS.get(eqn.primitive.name, ()):
            missing = batch_axes - _sharding.varying_axes(eqn.invars[position].aval)
            if missing:
                raise ValueError(_shared_draw_message(eqn, sorted(missing), axis_name))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _refuse_shared_draws(sub, batch_axes, axis_name)


def _shared_draw_message(eqn: Any, missing: list[str], axis_name: AxisName) -> str:
    """What a draw from a key that is the same on the devices along ``missing`` means, and
    the two fixes: one for numbers meant to differ from row to row, one for the same."""
    return (
        f"jaxaccum.value_and_grad: loss_fn draws random numbers"
        f" ({eqn.outvars[0].aval.str_short()}) from a PRNG key that is the same on every device"
        f" along {missing}. The typed keys among loss_fn's arguments are folded with the"
        " device's index; a key that loss_fn closes over (or keeps elsewhere, or makes from a"
        " constant seed) and a raw uint32 key (jax.random.PRNGKey) are not. If the numbers"
        " should differ from row to row (dropout: under plain jit each row draws its own), pass"
        " jax.random.key(seed) as an argument after params, or fold the key yourself:"
        f" jax.random.fold_in(key, jax.lax.axis_index({axis_name!r})). If they should be the"
        " same on every device (a fixed random projection, as plain jit draws it once), say so:"
        f" jax.lax.pcast(key, {axis_name!r}, to='varying')."
    )


def _device_index(axis_name: AxisName | None) -> jax.Array | None:
    """This device's index over ``axis_name`` where the code runs per device, else None."""
    if axis_name is None or _sharding.placement(axis_name) is not Placement.PER_DEVICE:
        return None
    try:
        return jax.lax.axis_index(axis_name)
    except NameError:  # the axis is not bound: not per device
        return None


def is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
