"""`restore_state`: a saved optimizer state on a new mesh, the open window carried over."""

from __future__ import annotations

from typing import Any, NamedTuple

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
    window's sums, which hold one row per device (where both states have rows:
    ``num_items`` one-dimensional). Onto as many devices or more the saved rows
    are copied as they are, zeros in the new rows; onto fewer, saved row ``i``
    of ``N`` is added (in float64, rounded once) onto new row ``i * M // N``: the
    rows an ``M``-device run's device holds (where ``M`` divides ``N``), so no
    row holds more than that run's would; onto a state without rows
    (one device, GSPMD, a parameter sharded over the batch axis) the rows are
    added up. The window's sum over devices is unchanged, and the resumed
    update matches the uninterrupted run's to the sums' rounding: bitwise on
    the same device count (rows copied); with another count, to float32
    rounding for float32 sums (``jaxaccum/_checkpoint_routes_test.py`` measures
    ``3e-8`` to ``6e-8`` on SGD steps of lr 0.5), to their own rounding for
    bfloat16 or float16 sums. A sum that is finite as saved but overflows its
    dtype in the new rows is refused.
    A ``pmap`` state (a copy of every leaf per device) restores onto a
    ``pmap`` state of the same device count only; onto a ``jit`` or
    ``shard_map`` state (or back) it is refused.

    The loss scale and its growth tracker are restored as saved (``like``'s own
    is not used): a state saved without ``loss_scaling`` holds scale 1, and no
    flag says whether scaling was on, so turning it on at a resume keeps scale 1.
    Start the scaled run fresh, or set the scale at a boundary (``window_step`` 0):
    ``state._replace(last_window=state.last_window._replace(loss_scale=jnp.float32(2.0**16)))``.

    Args:
      saved: the saved optimizer state (a pytree with ``like``'s paths).
      like: a fresh state of the same optimizer, laid out for the new mesh.

    Returns:
      ``saved``'s values in ``like``'s structure, shapes, dtypes and shardings.

    Raises:
      ValueError: a leaf of ``like`` is missing from ``saved`` (or the other
        way round), has a shape or dtype that no device count explains (another
        model, another ``accumulator_dtype``, another ``jax_enable_x64``, a
        ``pmap`` state on one side only), or a window sum overflows its dtype
        on the new rows.

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
    sums = _window_sums({_key(path): leaf for path, leaf in like_leaves}, saved_leaves)
    restored = []
    for path, target in like_leaves:
        key, where = _key(path), jax.tree_util.keystr(path)
        if key not in saved_leaves:
            raise ValueError(
                f"restore_state: `saved` has no leaf {where}, which `like` has: is `saved`"
                " the state of the same optimizer?"
            )
        restored.append(_leaf(saved_leaves.pop(key), target, where, sums.get(key)))
    if saved_leaves:
        raise ValueError(
            f"restore_state: `saved` has leaves that `like` does not: {sorted(saved_leaves)[:5]}"
        )
    return jax.tree.unflatten(treedef, restored)


class _DeviceRows(NamedTuple):
    """A window sum's field name, and its state's device rows (None: no rows) as saved
    and in ``like``."""

    field: str
    saved: int | None
    like: int | None


def _leaf(value: Any, target: Any, where: str, rows: _DeviceRows | None) -> Any:
    """One saved leaf as ``target`` is (``rows``: set for a window sum)."""
    if isinstance(target, int | float | bool):  # TrainState.create's step=0
        return _python_scalar(value, target, where)
    if is_key(target):
        return _prng_key(value, target, where)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        raise ValueError(
            f"restore_state: `saved` leaf {where} spans devices of other processes, which this"
            " one cannot read. Read the checkpoint onto this process's own CPU device in each"
            " process (Orbax, sharding=SingleDeviceSharding(jax.local_devices(backend='cpu')[0])),"
            " then restore_state."
        )
    value = np.asarray(value if hasattr(value, "dtype") else jax.numpy.asarray(value))
    value = _same(value, target, where) if rows is None else _window_sum(value, target, where, rows)
    return _place(value, target)


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


def _window_sums(like: dict, saved: dict) -> dict[tuple[str, ...], _DeviceRows]:
    """The window-sum leaves of ``like`` (by key), under a ``MultiStepsState`` as a NamedTuple
    or as the dict that ``nnx.state`` and Orbax make of it (found by its field names), each
    with its state's device rows in ``saved`` and in ``like``."""
    marker = MultiStepsState._fields[0]  # "window_step": a leaf of every such state
    states = {key[:i] for key in like for i, name in enumerate(key) if name == marker}
    rows = {state: (_rows(saved, state), _rows(like, state)) for state in states}
    sums = {}
    for key in like:
        found = [i for i, name in enumerate(key) if name in _WINDOW_SUMS and key[:i] in states]
        if found:
            sums[key] = _DeviceRows(key[found[0]], *rows[key[: found[0]]])
    return sums


def _rows(leaves: dict, state: tuple[str, ...]) -> int | None:
    """The device rows of the state at ``state``: the length of its ``num_items`` (an NNX
    state's holds it under ``value``) where that is one-dimensional, else None (one device
    or GSPMD: a scalar; ``pmap``: a copy per device of one row)."""
    where = (*state, "num_items")
    found = [leaf for key, leaf in leaves.items() if key[: len(where)] == where]
    if len(found) != 1 or np.ndim(found[0]) != 1:
        return None
    return int(np.shape(found[0])[0])


def _same(value: np.ndarray, target: Any, where: str, field: str | None = None) -> np.ndarray:
    """``value`` as it is, if it has ``target``'s shape and dtype; else an error naming the
    likely cause (``field``: the window sum's name, for a dtype's hint)."""
    shape = tuple(target.shape)
    if value.shape == shape and value.dtype == target.dtype:
        return value
    if value.dtype != target.dtype:
        hint = _dtype_hint(value.dtype, np.dtype(target.dtype), field)
    else:
        hint = _shape_hint(value.shape, shape)
    raise ValueError(
        f"restore_state: leaf {where} was saved as {value.dtype}{list(value.shape)};"
        f" `like` has {target.dtype}{list(shape)}.{hint}"
    )


def _dtype_hint(saved: np.dtype, like: np.dtype, field: str | None) -> str:
    """The setting that changes a leaf's dtype between the saving run and this one."""
    hint = ""
    if field == "grad_sum":
        hint += (
            " The gradient sums' `accumulator_dtype` differs: make `like` with the saved"
            f" one ({saved}); an open window's sums are not recast."
        )
    if np.dtype(np.float64) in (saved, like):
        hint += (
            " float64 on one side only: `jax_enable_x64` (which float64 sums,"
            " `accumulator_dtype=jnp.float64`, need; their items and loss sums are float64"
            " too) differs between the saving run and this one."
        )
    return hint


def _shape_hint(saved: tuple[int, ...], like: tuple[int, ...]) -> str:
    """What a leaf's shapes that differ say about ``saved`` and ``like``."""
    pmap_only = " restores onto a `pmap` state of the same number of devices only."
    if len(saved) == len(like) + 1 and saved[1:] == like:  # a copy per device onto one copy
        return " `saved` looks like a `pmap` state (a copy of every leaf per device), which" + (
            pmap_only
        )
    if len(like) == 1 and not saved:  # one copy onto a copy per device (a scalar's)
        return (
            " Either `saved` holds another model's state, or `like` is a `pmap` state (a copy"
            " of every leaf per device): a `pmap` state" + pmap_only + " For a `jit` or"
            " `shard_map` state, make `like` with `tx.init` on the new mesh."
        )
    if len(saved) == len(like) > 0 and saved[1:] == like[1:]:  # pmap's devices, or a size
        return (
            " Either `saved` holds another model's state (other parameter shapes), or it"
            " is a `pmap` state (a copy of every leaf per device), which" + pmap_only
        )
    return " Is `saved` the state of the same model and optimizer?"


def _window_sum(value: np.ndarray, target: Any, where: str, rows: _DeviceRows) -> np.ndarray:
    """A saved window sum in the target's layout, its total over devices unchanged.

    A leading axis is read as device rows only where its state has rows (``rows``), and
    the shape per row must be the target's.
    """
    shape, dtype = tuple(target.shape), np.dtype(target.dtype)
    # the same layout (or an FSDP sum, sharded like its parameter), or another dtype
    if value.shape == shape or value.dtype != dtype:
        return _same(value, target, where, rows.field)
    saved, like = rows.saved, rows.like
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below
        if saved and like and value.shape == (saved, *shape[1:]) and shape[0] == like:
            restored = _fold(value, like, dtype)
        elif saved and value.shape == (saved, *shape):  # rows onto one sum
            restored = value.astype(np.float64).sum(axis=0).astype(dtype)
        elif like and shape == (like, *value.shape):  # one sum onto rows: into the first
            restored = np.zeros(shape, dtype)
            restored[0] = value
        else:
            raise ValueError(
                f"restore_state: window sum {where} was saved as {value.dtype}"
                f"{list(value.shape)} ({_rows_words(saved)}); `like` has {dtype}{list(shape)}"
                f" ({_rows_words(like)}): no device count maps one onto the other. Is"
                " `saved` the state of the same model (the same parameter shapes)?"
            )
    if np.isfinite(value).all() and not np.isfinite(restored).all():
        raise ValueError(
            f"restore_state: window sum {where} is finite as saved ({_rows_words(saved)}),"
            f" but added onto {_rows_words(like)} it overflows {dtype} (largest"
            f" {float(np.finfo(dtype).max):g}). {_more_rows(saved) if like else ''}Finish the"
            " open window before you save (a sum without device rows holds all of it)."
        )
    return restored


def _more_rows(saved: int | None) -> str:
    return f"Restore it onto {saved} devices or more (the rows are copied as they are). "


def _rows_words(rows: int | None) -> str:
    return "no device rows" if rows is None else f"{rows} device rows"


def _fold(value: np.ndarray, rows: int, dtype: np.dtype) -> np.ndarray:
    """Saved device rows onto ``rows`` rows: saved row ``i`` of ``N`` onto row ``i * rows // N``
    (consecutive rows, as a run on ``rows`` devices splits the batch), added
    in float64 and rounded once (copied as they are, zeros after them, onto as many or
    more rows), so that no row holds more than a run on ``rows`` devices would."""
    folded = np.zeros((rows, *value.shape[1:]), np.float64 if rows < len(value) else dtype)
    if rows >= len(value):
        folded[: len(value)] = value
        return folded
    np.add.at(folded, np.arange(len(value)) * rows // len(value), value.astype(np.float64))
    return folded.astype(dtype)


def _place(value: np.ndarray, target: Any) -> jax.Array:
    """``value`` placed as ``target`` is: in its sharding, or uncommitted where ``target`` is
    (what ``init`` leaves a scalar under GSPMD, free to join the step's sharded arguments)."""
    sharding = getattr(target, "sharding", None)
    if sharding is None or not getattr(target, "committed", True):
        return jax.numpy.asarray(value)
    return jax.device_put(value, sharding)
