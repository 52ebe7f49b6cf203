"""One ``multi_steps`` micro-step in every data-parallel mode: :func:`data_parallel`.

The body is the README's (``value_and_grad -> update -> apply_updates``,
:func:`micro_step`); the modes differ only in how params, state and batches are
placed and how the body is mapped: on a mesh under ``jit`` (:func:`_jitted`:
one device, an Explicit mesh, GSPMD), under ``shard_map`` (:func:`_shard_mapped`),
or with a leading device axis (:func:`_stacked`: ``pmap``, ``vmap`` lanes).
The unit tests and the parity suite run their data-parallel windows here;
:func:`mode_for` is the suite's choice of mode for R ranks on this host.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

AXIS = "data"

MODES = ("one_device", "jit", "gspmd", "shard_map", "pmap", "vmap")


@dataclasses.dataclass
class DataParallel:
    """A ``multi_steps`` training loop on ``devices`` devices in one mode.

    Batches are given per device, ``[devices, rows, ...]`` leaves (a window's
    micro-batch on each device); :meth:`step` lays them out for the mode.

    Attributes:
      mode: one of :data:`MODES`.
      init: ``params -> (params, state)``, both placed for the mode.
      step: ``(params, state, batch, **update_kwargs) -> (params, state)``.
      one: a replicated output as one numpy copy (``pmap``/``vmap`` stack them).
      compiled: ``(params, state, batch) ->`` the compiled micro-step (its
        ``memory_analysis()``: the buffers XLA assigned).
    """

    mode: str
    init: Callable[[Any], tuple[Any, Any]]
    step: Callable[..., tuple[Any, Any]]
    one: Callable[[Any], Any]
    compiled: Callable[[Any, Any, Any], Any]

    def hlo(self, params: Any, state: Any, batch: Any) -> str:
        """The compiled micro-step's HLO text."""
        return self.compiled(params, state, batch).as_text()


def mode_for(devices: int, *, lanes: bool = False) -> str:
    """How ``devices`` ranks run on this host: ``one_device`` for one; plain ``jit`` on an
    Explicit mesh when JAX has devices enough (and not ``lanes``); else ``vmap`` lanes."""
    if devices == 1:
        return "one_device"
    return "jit" if len(jax.devices()) >= devices and not lanes else "vmap"


def data_parallel(
    tx_fn: Callable[[str | None], optax.GradientTransformation],
    loss_fn: Callable,
    mode: str,
    devices: int,
    *,
    donate: bool = False,
    loss_scale: str | float | None = None,
) -> DataParallel:
    """The README's micro-step (``value_and_grad -> update -> apply_updates``) in ``mode``.

    Args:
      tx_fn: ``axis_name -> multi_steps(...)`` (the axis name is ``None`` for
        ``one_device`` and ``gspmd``).
      loss_fn: ``(params, batch) -> (loss_sum, num_items)``.
      mode: ``one_device`` (``devices`` must be 1), ``jit`` (plain ``jax.jit`` on an
        Explicit mesh), ``gspmd`` (``jit`` on an Auto mesh, no axis name),
        ``shard_map``, ``pmap`` or ``vmap`` (lanes with an axis name).
      devices: the number of devices (JAX's first ones).
      donate: donate params and state (``jit`` modes).
      loss_scale: ``jaxaccum.value_and_grad``'s ``loss_scale``: None (the summed loss
        as it is), a number (that constant: 1.0 still takes the scaled path), or
        ``"state"`` (``jaxaccum.loss_scale(state)``, a ``multi_steps`` with ``loss_scaling``).

    Raises:
      ValueError: an unknown ``mode``.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    axis = None if mode in ("one_device", "gspmd") else AXIS
    tx = tx_fn(axis)
    body = micro_step(tx, loss_fn, axis if mode != "vmap" else None, loss_scale)
    donated = dict(donate_argnums=(0, 1)) if donate else {}
    if mode == "shard_map":
        return _shard_mapped(devices, tx, body, donated)
    if mode in ("pmap", "vmap"):
        return _stacked(mode, devices, tx, body)
    return _jitted(mode, devices, tx, body, donated)


def micro_step(
    tx: optax.GradientTransformation,
    loss_fn: Callable,
    grad_axis: str | None,
    loss_scale: str | float | None = None,
) -> Callable:
    """``body(params, state, batch, **update_kwargs) -> (params, state)``: the README's step.

    ``grad_axis`` is ``jaxaccum.value_and_grad``'s axis (a ``vmap`` lane
    differentiates its own rows: None); ``loss_scale`` as :func:`data_parallel`'s.
    """
    grad_fn = jaxaccum.value_and_grad(loss_fn, axis_name=grad_axis)

    def body(params, state, batch, **kw):
        scale = jaxaccum.loss_scale(state) if loss_scale == "state" else loss_scale
        (loss_sum, num_items), grads = grad_fn(params, batch, loss_scale=scale)
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum,
                                   **kw)  # fmt: skip
        return optax.apply_updates(params, updates), state

    return body


def _rows(batch: Any) -> Any:
    """Per-device leaves ``[devices, rows, ...]`` as one global batch ``[devices * rows, ...]``."""
    return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)


def _jitted(mode: str, devices: int, tx, body: Callable, donated: dict) -> DataParallel:
    """``one_device``, ``jit`` (Explicit mesh, under ``jax.set_mesh``) or ``gspmd`` (Auto mesh)."""
    types = {"jit": jax.sharding.AxisType.Explicit, "gspmd": jax.sharding.AxisType.Auto}
    mesh = None
    if mode != "one_device":
        mesh = jax.make_mesh((devices,), (AXIS,), axis_types=(types[mode],),
                             devices=jax.devices()[:devices])  # fmt: skip
    context = (lambda: jax.set_mesh(mesh)) if mode == "jit" else contextlib.nullcontext
    jitted = jax.jit(body, **donated)

    def init(params):
        with context():
            if mesh is not None:
                params = jax.device_put(params, NamedSharding(mesh, P()))
            state = jax.jit(tx.init)(params)
            if mode == "gspmd":
                state = jax.device_put(state, NamedSharding(mesh, P()))
            return params, state

    def placed(batch):
        batch = _rows(batch)
        return batch if mesh is None else jax.device_put(batch, NamedSharding(mesh, P(AXIS)))

    def step(params, state, batch, **kw):
        with context():
            return jitted(params, state, placed(batch), **kw)

    def compiled(params, state, batch):
        with context():
            return jitted.lower(params, state, placed(batch)).compile()

    return DataParallel(mode, init, step, jax.device_get, compiled)


def _shard_mapped(devices: int, tx, body: Callable, donated: dict) -> DataParallel:
    """``shard_map`` over a mesh of ``devices``: per-device state (``partition_specs``)."""
    mesh = jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices])
    specs = None

    def init(params):
        nonlocal specs
        specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, params), AXIS)
        params = jax.device_put(params, NamedSharding(mesh, P()))
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
        return params, state(params)

    @partial(jax.jit, static_argnames=("kw_names",), **donated)
    def mapped(params, state, batch, kw_values, kw_names):
        def per_device(params, state, batch, kw_values):
            kw = dict(zip(kw_names, kw_values, strict=True))
            return body(params, state, jax.tree.map(lambda x: x[0], batch), **kw)

        sm = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), specs, P(AXIS), P()),
                           out_specs=(P(), specs))  # fmt: skip
        return sm(params, state, batch, kw_values)

    placed = lambda batch: jax.device_put(batch, NamedSharding(mesh, P(AXIS)))

    def step(params, state, batch, **kw):
        return mapped(params, state, placed(batch), tuple(kw.values()), tuple(kw))

    def compiled(params, state, batch):
        return mapped.lower(params, state, placed(batch), (), ()).compile()

    return DataParallel("shard_map", init, step, jax.device_get, compiled)


def _stacked(mode: str, devices: int, tx, body: Callable) -> DataParallel:
    """``pmap`` or ``vmap``: every leaf carries a leading device axis; update keywords are
    the same on every device (``in_axes`` None)."""
    stack = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (devices,) + x.shape), tree)
    positional = lambda params, state, batch, kw_values, kw_names: body(
        params, state, batch, **dict(zip(kw_names, kw_values, strict=True))
    )
    if mode == "pmap":
        pmapped = partial(jax.pmap, axis_name=AXIS, devices=jax.devices()[:devices])
        mapped = pmapped(positional, in_axes=(0, 0, 0, None), static_broadcasted_argnums=(4,))
        init_mapped = pmapped(lambda p: (p, tx.init(p)))
    else:
        vmapped = jax.vmap(positional, in_axes=(0, 0, 0, None, None), axis_name=AXIS)
        mapped = jax.jit(vmapped, static_argnums=(4,))
        init_mapped = jax.jit(jax.vmap(lambda p: (p, tx.init(p)), axis_name=AXIS))
    return DataParallel(
        mode,
        lambda params: init_mapped(stack(params)),
        lambda params, state, batch, **kw: mapped(
            params, state, batch, tuple(kw.values()), tuple(kw)
        ),  # fmt: skip
        lambda x: jax.tree.map(lambda a: np.asarray(a)[0], x),
        lambda params, state, batch: mapped.lower(params, state, batch, (), ()).compile(),
    )
