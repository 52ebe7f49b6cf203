"""`restore_state`: a saved optimizer state on a new mesh, the open window carried over."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxaccum._state import MultiStepsState
from jaxaccum._streams import is_key

_WINDOW_SUMS = ("grad_sum", "loss_sum", "num_items")


def restore_state(saved: Any, like: Any) -> Any:
    """A saved optimizer state laid out like ``like``, on any number of devices.

    ``like`` is a freshly initialized optimizer state on the new mesh (``tx.init``
    under ``jax.set_mesh``, under ``jax.shard_map`` with
    :func:`jaxaccum.partition_specs`, or ``nnx.state(optimizer)`` of a fresh
    ``nnx.Optimizer``); ``saved`` is the same optimizer's state as
    saved: arrays or numpy (``jax.device_get``, or Orbax's restore with or
    without a target, whose NamedTuples come back as dicts), from any device
    count. Every leaf is copied into ``like``'s sharding, except the open
    window's sums, which hold one row per device: the rows are added up (in
    float64) and the total is written into the first row of the new layout,
    zeros in the others. The window's sum over devices is unchanged, so the
    window finishes as it would have (to float32 rounding; bitwise when the
    device count is the same, since then the rows are copied as they are).
    A ``pmap`` state (a copy of every leaf per device) restores onto the same
    device count only.

    Args:
      saved: the saved optimizer state (a pytree with ``like``'s paths).
      like: a fresh state of the same optimizer, laid out for the new mesh.

    Returns:
      ``saved``'s values in ``like``'s structure, shapes, dtypes and shardings.

    Raises:
      ValueError: a leaf of ``like`` is missing from ``saved`` (or the other
        way round), or has a shape or dtype that no device count explains.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxaccum
      >>> tx = jaxaccum.multi_steps(optax.sgd(1.0), 2)
      >>> params = {'w': jnp.zeros(2)}
      >>> _, state = tx.update({'w': jnp.ones(2)}, tx.init(params), params, num_items=1)
      >>> restored = jaxaccum.restore_state(jax.device_get(state), like=tx.init(params))
      >>> int(restored.window_step), float(restored.num_items)
      (1, 1.0)
    """
    saved_leaves = {_key(path): leaf for path, leaf in _leaves_with_paths(saved)}
    like_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    sums = _window_sum_paths([_key(path) for path, _ in like_leaves])
    restored = []
    for path, target in like_leaves:
        key = _key(path)
        if key not in saved_leaves:
            raise ValueError(
                f"restore_state: `saved` has no leaf {jax.tree_util.keystr(path)}, which"
                " `like` has: is `saved` the state of the same optimizer?"
            )
        value, where = saved_leaves.pop(key), jax.tree_util.keystr(path)
        if isinstance(target, int | float | bool):  # TrainState.create's step=0
            restored.append(_python_scalar(value, target, where))
            continue
        if is_key(target):
            restored.append(_prng_key(value, target, where))
            continue
        value = np.asarray(value if hasattr(value, "dtype") else jax.numpy.asarray(value))
        value = _window_sum(value, target, where) if key in sums else _same(value, target, where)
        restored.append(_place(value, target))
    if saved_leaves:
        raise ValueError(
            f"restore_state: `saved` has leaves that `like` does not: {sorted(saved_leaves)[:5]}"
        )
    return jax.tree.unflatten(treedef, restored)


def _python_scalar(value: Any, target: int | float | bool, where: str) -> int | float | bool:
    """A Python scalar leaf of ``like`` (``TrainState.create``'s ``step=0``): the saved
    value as the same Python type, placed by the step that uses it (no device)."""
    saved = np.asarray(value)
    if saved.shape != ():
        raise ValueError(
            f"restore_state: leaf {where} was saved with shape {list(saved.shape)}; `like`"
            f" has a Python {type(target).__name__}."
        )
    return type(target)(saved.item())


def _prng_key(value: Any, target: jax.Array, where: str) -> jax.Array:
    """A typed PRNG key leaf (a module's dropout stream), saved as a key or as its data."""
    data = np.asarray(jax.random.key_data(value) if is_key(value) else value)
    data = _same(data, jax.random.key_data(target), where)
    key = jax.random.wrap_key_data(data, impl=jax.random.key_impl(target))
    return _place(key, target)


def _leaves_with_paths(tree: Any) -> list:
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _key(path: tuple) -> tuple[str, ...]:
    """A path by names alone: a NamedTuple field and a dict key of that name match."""
    names = []
    for entry in path:
        for attr in ("name", "key", "idx"):
            if hasattr(entry, attr):
                names.append(str(getattr(entry, attr)))
                break
        else:
            names.append(str(entry))
    return tuple(names)


def _window_sum_paths(keys: list[tuple[str, ...]]) -> set[tuple[str, ...]]:
    """The window-sum leaves among ``keys``: under a ``MultiStepsState``, as a NamedTuple
    or as the dict that ``nnx.state`` and Orbax make of it (found by its field names)."""
    marker = MultiStepsState._fields[0]  # "window_step": a leaf of every such state
    states = {key[:i] for key in keys for i, name in enumerate(key) if name == marker}
    return {
        key
        for key in keys
        for i, name in enumerate(key)
        if name in _WINDOW_SUMS and key[:i] in states
    }


def _same(value: np.ndarray, target: Any, where: str) -> np.ndarray:
    if value.shape != tuple(target.shape) or value.dtype != target.dtype:
        copies = value.ndim == target.ndim > 0 and value.shape[1:] == tuple(target.shape[1:])
        per_device = value.ndim == target.ndim + 1 and value.shape[1:] == tuple(target.shape)
        if value.dtype != target.dtype:
            hint = ""
        elif per_device:  # a copy per device onto one copy
            hint = (
                " `saved` looks like a `pmap` state (a copy of every leaf per device), which"
                " restores onto a `pmap` state of the same number of devices only."
            )
        elif copies:  # a leading axis apart: a pmap state's devices, or another model's size
            hint = (
                " Either `saved` holds another model's state (other parameter shapes), or it"
                " is a `pmap` state (a copy of every leaf per device), which restores onto"
                " the same number of devices only."
            )
        else:
            hint = " Is `saved` the state of the same model and optimizer?"
        raise ValueError(
            f"restore_state: leaf {where} was saved as {value.dtype}{list(value.shape)};"
            f" `like` has {target.dtype}{list(target.shape)}.{hint}"
        )
    return value


def _window_sum(value: np.ndarray, target: Any, where: str) -> np.ndarray:
    """A saved window sum in the target's layout, its total over devices unchanged."""
    shape = tuple(target.shape)
    # the same layout (or an FSDP sum, sharded like its parameter), or another accumulator_dtype
    if value.shape == shape or value.dtype != target.dtype:
        return _same(value, target, where)
    wide = value.astype(np.float64)
    if value.ndim == len(shape) and value.shape[1:] == shape[1:]:  # rows, another count
        total = wide.sum(axis=0)
    elif value.ndim == len(shape) + 1 and value.shape[1:] == shape:  # rows onto one device
        return wide.sum(axis=0).astype(target.dtype)
    elif value.ndim + 1 == len(shape) and value.shape == shape[1:]:  # one device onto rows
        total = wide
    else:
        raise ValueError(
            f"restore_state: window sum {where} was saved with shape {list(value.shape)};"
            f" `like` has {list(shape)}, and no device count maps one onto the other."
        )
    rows = np.zeros(shape, np.float64)
    rows[0] = total  # the devices' rows add up to the saved total
    return rows.astype(target.dtype)


def _place(value: np.ndarray, target: Any) -> jax.Array:
    """``value`` placed as ``target`` is: in its sharding, or uncommitted where ``target`` is
    (what ``init`` leaves a scalar under GSPMD, free to join the step's sharded arguments)."""
    sharding = getattr(target, "sharding", None)
    if sharding is None or not getattr(target, "committed", True):
        return jax.numpy.asarray(value)
    return jax.device_put(value, sharding)
