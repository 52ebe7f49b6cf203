"""Argument checks: a bad input gets an error naming the argument and what was expected.

Every check runs before anything is computed, so a refused call leaves the
optimizer state as it was. Traced values are checked for dtype and shape only;
their values are checked where they take effect (a NaN ``num_items`` makes its
window non-finite, and the window is skipped).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxaccum import _sharding
from jaxaccum._sharding import AxisName, Placement
from jaxaccum._state import MultiStepsState


def _dtype_of(value: Any) -> np.dtype | None:
    """The dtype of a number or an array; None for anything else (a str, None)."""
    if isinstance(value, bool):
        return np.dtype(np.bool_)
    if isinstance(value, numbers.Integral):
        return np.dtype(np.int64)
    if isinstance(value, numbers.Real):
        return np.dtype(np.float64)
    dtype = getattr(value, "dtype", None)
    try:
        return None if dtype is None else np.dtype(dtype)
    except TypeError:
        return None


def _kind_matches(dtype: np.dtype, kind: str) -> bool:
    if kind == "bool":
        return dtype == np.bool_
    is_int = np.issubdtype(dtype, np.integer)
    if kind == "int":
        return is_int
    return is_int or jnp.issubdtype(dtype, jnp.floating)  # "real", bfloat16 included


def _describe(value: Any) -> str:
    if isinstance(value, np.generic):
        return f"a numpy {value.dtype} scalar"
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"an array of dtype {value.dtype} and shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def scalar(
    value: Any,
    name: str,
    *,
    where: str,
    kind: str,
    expected: str,
    ok: Callable[[Any], bool] | None = None,
) -> None:
    """The one scalar validator.

    Args:
      value: a Python number, a numpy or JAX scalar, or a tracer.
      name: the argument's name, quoted in the error.
      where: who is asking (``"multi_steps.update"``), the error's prefix.
      kind: ``"real"`` (an int or a float, never a bool), ``"int"`` (never a
        bool) or ``"bool"``.
      expected: what the error says the argument must be ("a finite real
        number >= 0").
      ok: a test of the concrete value; not run for traced values.

    Raises:
      TypeError: not a number of that kind.
      ValueError: not a scalar, or ``ok`` refused the value.
    """
    dtype = _dtype_of(value)
    if dtype is None or not _kind_matches(dtype, kind):
        raise TypeError(f"{where}: `{name}` must be {expected}; got {_describe(value)}.")
    if np.size(value) != 1:
        raise ValueError(f"{where}: `{name}` must be a scalar; got shape {np.shape(value)}.")
    if ok is not None and not isinstance(value, jax.core.Tracer):
        concrete = np.asarray(value).reshape(()).item()
        if not ok(concrete):
            raise ValueError(f"{where}: `{name}` must be {expected}; got {concrete!r}.")


def one_of(value: Any, name: str, choices: tuple[Any, ...], *, where: str) -> None:
    if not any(value is c or (isinstance(value, str) and value == c) for c in choices):
        options = " or ".join(repr(c) for c in choices)
        raise ValueError(f"{where}: `{name}` must be {options}; got {value!r}.")


def instance_or_none(value: Any, name: str, cls: type, *, where: str) -> None:
    if value is not None and not isinstance(value, cls):
        raise TypeError(
            f"{where}: `{name}` must be a jaxaccum.{cls.__name__} or None; got"
            f" {type(value).__name__}."
        )


def every_k_schedule(schedule: Any) -> Callable[[jax.Array], jax.Array]:
    """``every_k_schedule`` as a function ``update_id -> int32 k``."""
    where = "multi_steps"
    if not callable(schedule):
        expected = "an int >= 1 (micro-batches per update) or a callable update_id -> int"
        scalar(schedule, "every_k_schedule", where=where, kind="int", expected=expected,
               ok=lambda k: k >= 1)  # fmt: skip
        if not isinstance(schedule, numbers.Integral):  # a 0-d integer array
            raise TypeError(
                f"{where}: `every_k_schedule` must be {expected}; got {_describe(schedule)}."
            )
        k = int(schedule)
        return lambda update_id: jnp.asarray(k, jnp.int32)
    first = schedule(jnp.asarray(0, jnp.int32))
    if not isinstance(first, jax.core.Tracer):
        scalar(
            first,
            "every_k_schedule(0)",
            where=where,
            kind="int",
            expected="an int scalar >= 1 (micro-batches per update)",
            ok=lambda k: k >= 1,
        )

    def window_size(update_id: jax.Array) -> jax.Array:
        k = schedule(update_id)
        if not jnp.issubdtype(jnp.result_type(k), jnp.integer):
            raise TypeError(
                f"{where}: `every_k_schedule` must return an int number of micro-batches;"
                f" got dtype {jnp.result_type(k)}."
            )
        return jnp.asarray(k, jnp.int32)

    return window_size


def axis_name(value: Any) -> AxisName | None:
    ok = value is None or isinstance(value, str)
    ok |= isinstance(value, tuple) and len(value) > 0 and all(isinstance(a, str) for a in value)
    if not ok:
        raise TypeError(
            "multi_steps: `axis_name` must be None, a mesh axis name (str) or a tuple of"
            f" them; got {_describe(value)}."
        )
    return value


def max_grad_norm(value: Any) -> float | None:
    if value is None:
        return None
    scalar(
        value,
        "max_grad_norm",
        where="multi_steps",
        kind="real",
        expected="None or a finite number > 0",
        ok=lambda v: np.isfinite(v) and v > 0,
    )
    return float(value)


def accumulator_dtype(value: Any) -> np.dtype:
    dtype = jnp.dtype(value)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            "multi_steps: `accumulator_dtype` must be a real floating dtype (float32 by"
            f" default); got {dtype}."
        )
    return dtype


def num_items(value: Any) -> None:
    """``num_items``: required, a real scalar >= 0 (a concrete one must be finite)."""
    if value is None:
        raise TypeError(
            "multi_steps.update: `num_items` is required: the number of items (valid"
            " tokens, or samples) that the summed loss behind `grads` adds up. Pass"
            " num_items=0 for a micro-batch without any."
        )
    scalar(
        value,
        "num_items",
        where="multi_steps.update",
        kind="real",
        expected="a finite real number >= 0 (a count, or a weight, of items)",
        ok=lambda v: np.isfinite(v) and v >= 0,
    )


def grads(grads: Any, grad_sum: Any, *, per_device: bool, rows: bool = False) -> None:
    """``grads`` has the parameters' structure, shapes and a floating dtype.

    ``per_device``: each sum has a leading device axis of length 1 (``shard_map``);
    ``rows``: sums may hold one row per device (``jit`` on an Explicit mesh).
    """
    grads_def, sums_def = jax.tree.structure(grads), jax.tree.structure(grad_sum)
    if grads_def != sums_def:
        raise ValueError(
            "multi_steps.update: `grads` does not have the structure of the parameters"
            f" passed to init.\n  grads: {grads_def}\n  state: {sums_def}"
        )
    for (path, g), s in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grad_sum), strict=True
    ):
        where = jax.tree_util.keystr(path)
        if per_device and (s.ndim == 0 or s.shape[0] != 1):
            raise ValueError(
                f"multi_steps.update: the state's window sum {where} has shape"
                f" {tuple(s.shape)}, without the leading device axis of length 1 that"
                " multi_steps(..., axis_name=...) gives it: was this state made by a"
                " multi_steps without the same axis_name?"
            )
        expected = s.shape[1:] if per_device else s.shape
        if rows and s.ndim == np.ndim(g) + 1:
            expected = s.shape[1:]
        if tuple(np.shape(g)) != tuple(expected):
            hint = ""
            if not per_device and s.ndim and s.shape[0] == 1:
                hint = (
                    " (a state made with an axis_name carries a leading device axis of"
                    " length 1; is the axis_name the same?)"
                )
            raise ValueError(
                f"multi_steps.update: `grads` leaf {where} has shape {tuple(np.shape(g))};"
                f" the state expects {tuple(expected)}{hint}."
            )
        dtype = jnp.result_type(g)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"multi_steps.update: `grads` leaf {where} has dtype {dtype}; expected a"
                " real floating dtype."
            )


def update_call(
    grads_value, state, num_items_value, loss_sum, end_window, extra_args, placement, axis_name
) -> None:
    """Refuses a bad call before anything is computed: the state is never touched."""
    where = "multi_steps.update"
    if not isinstance(state, MultiStepsState):
        raise TypeError(
            f"{where}: `state` must be the MultiStepsState returned by init; got"
            f" {type(state).__name__}."
        )
    if "count" in extra_args:
        raise TypeError(
            f"{where}: `count` was renamed `num_items` in jaxaccum 0.2.0 (in optax every"
            " `count` is a step counter); pass num_items=..."
        )
    num_items(num_items_value)
    if loss_sum is not None:
        scalar(loss_sum, "loss_sum", where=where, kind="real", expected="a real number")
    scalar(end_window, "end_window", where=where, kind="bool", expected="a bool scalar")
    grads(
        grads_value,
        state.grad_sum,
        per_device=placement is Placement.PER_DEVICE,
        rows=placement is Placement.EXPLICIT,
    )
    if placement is Placement.PER_DEVICE:
        _axis_bound(axis_name)
        _block_norms_visible(axis_name)
        _grads_not_summed(grads_value, axis_name)
    elif placement is Placement.EXPLICIT:
        _grads_join_without_collective(grads_value, state.grad_sum, axis_name)


def _axis_bound(axis_name: AxisName) -> None:
    for name in _sharding.axes(axis_name):
        try:
            jax.lax.axis_size(name)
        except NameError:
            raise NameError(
                f"multi_steps: axis_name {name!r} is not bound here: call update inside"
                " jax.jit on a mesh with that axis (jax.set_mesh), jax.shard_map over it or"
                " jax.pmap(..., axis_name=...), or build multi_steps without axis_name."
            ) from None


def _vma_checked(axis_name: AxisName) -> bool:
    """Under ``shard_map``: whether JAX tracks which values vary over the axis."""
    index = jax.lax.axis_index(axis_name)
    return frozenset(_sharding.axes(axis_name)) <= _sharding.varying_axes(index)


def _block_norms_visible(axis_name: AxisName) -> None:
    """Under ``shard_map`` on a mesh with other axes, vma checking must be on: it tells
    which gradients are blocks of a parameter sharded over them (for the global norm)."""
    mesh = jax.sharding.get_abstract_mesh()
    others = [
        a
        for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == AxisType.Manual and a not in _sharding.axes(axis_name) and mesh.shape[a] > 1
    ]
    if others and not _vma_checked(axis_name):
        raise ValueError(
            f"multi_steps.update: under shard_map with check_vma=False on a mesh with other axes"
            f" ({others}), multi_steps cannot tell which gradients are blocks of a"
            " parameter sharded over them, so the window's gradient norm (clipping, the"
            " skip of a non-finite window) would be one device's block. Use"
            " check_vma=True (shard_map's default)."
        )


def _grads_not_summed(grads: Any, axis_name: AxisName) -> None:
    """Per device: refuses gradients that autodiff already summed over the devices.

    With vma checking (``shard_map``'s default) the gradient with respect to
    replicated parameters of a per-device loss is summed over the axis on every
    micro-step; the boundary's ``psum`` would then count every device ``R``
    times, whatever ``num_items`` is. Such a leaf does not vary over the axis.
    Without vma checking (``check_vma=False``, ``pmap``) autodiff does not sum.
    """
    batch_axes = frozenset(_sharding.axes(axis_name))
    if not _vma_checked(axis_name):
        return
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        if not batch_axes <= _sharding.varying_axes(g):
            raise ValueError(
                f"multi_steps.update: `grads` leaf {jax.tree_util.keystr(path)} is already"
                f" summed over {sorted(batch_axes)} (it does not vary over the axis): the window's"
                f" sum would count every device {jax.lax.axis_size(axis_name)} times."
                " Inside shard_map, take per-device gradients:"
                f" jaxaccum.value_and_grad(loss_fn, axis_name={axis_name!r}) differentiates"
                f" with respect to jax.lax.pcast(params, {axis_name!r}, to='varying'); the"
                " window's single psum happens at the boundary."
            )


def _grads_join_without_collective(grads: Any, grad_sum: Any, axis_name: AxisName) -> None:
    """Under ``jit``: each leaf must be unreduced over the axis, or sharded like its sum
    (FSDP). A replicated gradient was all-reduced already this micro-step."""
    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, g), window_sum in zip(leaves, jax.tree.leaves(grad_sum), strict=True):
        expected = _sharding.arrival_spec(window_sum, jnp.ndim(g), axis_name)
        if not _same_spec(_sharding.spec_of(g), expected, jnp.ndim(g)):
            raise ValueError(
                f"multi_steps.update: `grads` leaf {jax.tree_util.keystr(path)} has type"
                f" {jax.typeof(g)}; to join its window sum with no collective it must be"
                f" {_spec_words(expected)}. Under jax.jit on an"
                " Explicit mesh, take the gradients with"
                f" jaxaccum.value_and_grad(loss_fn, axis_name={axis_name!r}): it keeps each"
                " device's gradient a partial sum (unreduced, no all-reduce per micro-step);"
                " and make the state with tx.init under the same mesh. A replicated gradient"
                " was all-reduced already: for that (GSPMD) path build multi_steps without"
                " axis_name."
            )


def _spec_words(spec: P) -> str:
    """A spec in words, the same on every JAX version (their reprs differ)."""
    words = f"split as {tuple(spec.partitions)}"
    return words + (f", unreduced over {sorted(spec.unreduced)}" if spec.unreduced else "")


def _same_spec(a: P, b: P, ndim: int) -> bool:
    pad = lambda spec: tuple(spec.partitions) + (None,) * (ndim - len(spec.partitions))
    return (pad(a), a.unreduced, a.reduced) == (pad(b), b.unreduced, b.reduced)


def raise_if_nonfinite(overflow, micro_step, loss, grad_norm) -> None:
    """``nonfinite="raise"``: the host callback that fails a non-finite window."""
    if bool(overflow):
        raise FloatingPointError(
            "jaxaccum.multi_steps(nonfinite='raise'): the window ending at micro-step"
            f" {int(micro_step)} has a non-finite gradient or loss (loss={float(loss)},"
            f" grad_norm={float(grad_norm)}); it was not applied."
        )
