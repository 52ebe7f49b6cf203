"""Randomness per device: each device draws its own stream, as plain ``jit`` draws distinct rows.

``jaxaccum.value_and_grad`` runs the loss per device; a replicated key would
draw the same dropout mask on every device (:func:`own_streams`).
"""

from __future__ import annotations

from typing import Any

import jax
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
    already and is left as it is, so it draws what it draws on one device.
    Outside a per-device context, or without ``axis_name``, ``tree`` is
    returned as it is.
    """
    if axis_name is None or _sharding.placement(axis_name) is not Placement.PER_DEVICE:
        return tree
    try:
        index = jax.lax.axis_index(axis_name)
    except NameError:  # the axis is not bound: not per device
        return tree
    _refuse_raw_keys(tree, axis_name, index)
    batch_axes = frozenset(_sharding.axes(axis_name))

    def fold(x):
        if not is_key(x) or batch_axes <= _sharding.varying_axes(x):
            return x  # not a key, or keys split over the devices with the rows already
        return jnp.vectorize(lambda key: jax.random.fold_in(key, index))(x)

    return jax.tree.map(fold, tree)


def is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _refuse_raw_keys(tree: Any, axis_name: AxisName, index: jax.Array) -> None:
    """A raw ``uint32[2]`` key cannot be told from data: one that is the same on
    every device (seen where JAX tracks it, with vma checking) is refused, rather
    than draw one mask for every device."""
    batch_axes = frozenset(_sharding.axes(axis_name))
    if not batch_axes <= _sharding.varying_axes(index):
        return  # no vma checking: replicated and per-device values look alike
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        raw = getattr(x, "dtype", None) == jnp.uint32 and jnp.shape(x) == (2,)
        if raw and not batch_axes <= _sharding.varying_axes(x):
            raise TypeError(
                f"jaxaccum.value_and_grad: argument leaf {jax.tree_util.keystr(path)} is a"
                " uint32[2] array, a raw PRNG key (jax.random.PRNGKey): per device it would"
                " draw the same numbers on every device. Pass a typed key"
                " (jax.random.key(seed)); each device then draws its own stream."
            )
