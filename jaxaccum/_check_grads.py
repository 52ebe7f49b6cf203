"""The gradients handed to ``update`` fit the state and the route: structure, shapes, dtype,
and no collective already done; the window sums laid out for the mesh (every error names the leaf).

Per device (``shard_map``, ``pmap``): the axis is bound, the gradients were not
summed over it by autodiff, and block norms are visible. Under ``jit`` on an
Explicit mesh: each leaf joins its window sum with no collective.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxaccum import _sharding
from jaxaccum._sharding import AxisName


def match_state(grads: Any, grad_sum: Any, *, per_device: bool, rows: bool = False) -> None:
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
                f"multi_steps.update: `grads` leaf {where} has dtype {_dtype_name(dtype)};"
                " expected a real floating dtype." + _FLOAT0_HINT * (dtype == jax.dtypes.float0)
            )


_FLOAT0_HINT = (
    " float0 is the gradient of an integer or bool parameter (allow_int=True): keep such"
    " leaves out of the differentiated params, or give them a float zero gradient."
)


def _dtype_name(dtype: Any) -> str:
    """A dtype's name (float0's structured numpy form reads ``[('float0', 'V')]``)."""
    return "float0" if dtype == jax.dtypes.float0 else str(dtype)


def axis_bound(axis_name: AxisName, where: str = "multi_steps", call: str = "update") -> None:
    """The axis is one the call runs over: a mesh in context, ``shard_map`` or ``pmap``
    (``where`` and ``call``: the function that names it, and what to call there)."""
    for name in _sharding.axes(axis_name):
        try:
            jax.lax.axis_size(name)
        except NameError:
            raise NameError(
                f"{where}: axis_name {name!r} is not bound here: call {call} inside"
                " jax.jit on a mesh with that axis (jax.set_mesh), jax.shard_map over it or"
                f" jax.pmap(..., axis_name=...), or use {where} without axis_name."
            ) from None


def _vma_checked(axis_name: AxisName) -> bool:
    """Under ``shard_map``: whether JAX tracks which values vary over the axis."""
    index = jax.lax.axis_index(axis_name)
    return frozenset(_sharding.axes(axis_name)) <= _sharding.varying_axes(index)


def block_norms_visible(axis_name: AxisName) -> None:
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


def same_on_every_device(value: Any, name: str, axis_name: AxisName) -> None:
    """Per device: ``end_window`` closes every device's window or none (a device that
    closes alone would wait for the others in the window's reduction); an extra argument
    reaches the inner update that every device runs on the same window gradient."""
    varying = frozenset()
    for leaf in jax.tree.leaves(value):
        if isinstance(leaf, jax.Array):
            varying |= frozenset(_sharding.axes(axis_name)) & _sharding.varying_axes(leaf)
    if varying and _vma_checked(axis_name):
        why, fix = (
            ("a window closes on every device at once (its gradients are reduced over them)",
             "a Python bool, or a value that does not vary over the axis (jax.lax.pmax of the"
             " devices' flags, say)")
            if name == "end_window"
            else ("the inner update of the window runs on every device, which keeps the"
                  " parameters the same", "a Python value, or one that does not vary over the"
                  " axis (jax.lax.pmean of the devices' values, say)")
        )  # fmt: skip
        raise ValueError(
            f"multi_steps.update: `{name}` varies over {sorted(varying)}: {why}. Pass the"
            f" same value on every device: {fix}."
        )


def grads_not_summed(grads: Any, axis_name: AxisName) -> None:
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


def grads_join_without_collective(grads: Any, grad_sum: Any, axis_name: AxisName) -> None:
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


def grads_reduced(grads: Any) -> None:
    """Without ``axis_name``: a gradient left unreduced over a mesh axis (each device's
    partial sum) has nothing to reduce it; the window would add partial sums."""
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        partial = sorted(_sharding.spec_of(g).unreduced)
        if partial:
            axis = partial[0] if len(partial) == 1 else tuple(partial)
            leaf = f" leaf {jax.tree_util.keystr(path)}" if path else ""
            raise ValueError(
                f"multi_steps.update: `grads`{leaf} is unreduced"
                f" over mesh axis {axis!r} (each device's partial sum, as"
                f" jaxaccum.value_and_grad(..., axis_name={axis!r}) returns it), but this"
                f" multi_steps has no axis_name: build it with axis_name={axis!r}, the same"
                " axis as value_and_grad, to reduce the window once."
            )


def sums_in_rows(state: Any, grads: Any, axis_name: AxisName) -> None:
    """Under ``jit`` on an Explicit mesh: each window sum kept in rows holds one row per
    device. A state made outside the mesh, or for another number of devices, would be
    broadcast against the rows, adding its open window once per device."""
    devices = _sharding.devices_along(axis_name)
    sums = [
        (f"grad_sum{jax.tree_util.keystr(path)}", s, jnp.ndim(g))
        for (path, g), s in zip(
            jax.tree_util.tree_flatten_with_path(grads)[0],
            jax.tree.leaves(state.grad_sum),
            strict=True,
        )
    ]
    sums += [("loss_sum", state.loss_sum, 0), ("num_items", state.num_items, 0)]
    for where, window_sum, ndim in sums:
        if window_sum.ndim == ndim + 1 and window_sum.shape[0] != devices:
            raise ValueError(
                f"multi_steps.update: the state's window sum {where} has shape"
                f" {tuple(window_sum.shape)}; under jax.jit on an Explicit mesh with axis"
                f" {axis_name!r} ({devices} devices) it holds one row per device, shape"
                f" ({devices}, ...). Make the state with tx.init under jax.set_mesh(mesh); a"
                " state made outside the mesh or on another number of devices comes over"
                " with jaxaccum.restore_state."
            )


def _spec_words(spec: P) -> str:
    """A spec in words, the same on every JAX version (their reprs differ)."""
    words = f"split as {tuple(spec.partitions)}"
    return words + (f", unreduced over {sorted(spec.unreduced)}" if spec.unreduced else "")


def _same_spec(a: P, b: P, ndim: int) -> bool:
    pad = lambda spec: tuple(spec.partitions) + (None,) * (ndim - len(spec.partitions))
    return (pad(a), a.unreduced, a.reduced) == (pad(b), b.unreduced, b.reduced)
