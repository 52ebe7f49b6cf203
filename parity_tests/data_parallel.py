"""R data-parallel ranks for the jaxaccum runs: jaxaccum's first-class path, or vmap lanes.

One micro-step ``body(params, state, batch, *scalars)``, three ways to run it
(:attr:`Ranks.strategy`):

* ``jit`` (R > 1 and at least R devices; the 8 fake CPU devices): plain
  ``jax.jit`` on an Explicit mesh of JAX's first R devices, the README's
  data-parallel path: parameters replicated (``P()``), ``tx.init`` under
  ``jax.set_mesh``, each micro-step's global batch ``[R * mb, ...]`` split over
  ``"data"`` (rank r's rows on device r); ``multi_steps(..., axis_name="data")``
  and ``jaxaccum.value_and_grad(..., axis_name="data")`` keep the window's sums
  unreduced and reduce them once per window;
* ``vmap`` (fewer devices than R: one GPU): R ``jax.vmap`` lanes named
  ``"data"``, parameters and state with a leading R axis, each lane its rank's
  ``[mb, ...]``; the same reduction at the boundary, computed on one device;
* ``one_device`` (R = 1): plain ``jax.jit``, no axis.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"


class Ranks:
    """How R ranks run here (module docstring); ``strategy`` is recorded with each run."""

    def __init__(self, world: int, *, lanes: bool = False):
        """``world`` ranks; ``lanes``: vmap lanes even where there are devices enough."""
        self.world = world
        devices = jax.devices()
        if world == 1:
            self.strategy = "one_device"
        else:
            self.strategy = "jit" if len(devices) >= world and not lanes else "vmap"
        self.mesh = None
        if self.strategy == "jit":
            self.mesh = jax.make_mesh(
                (world,), (AXIS,), axis_types=(AxisType.Explicit,), devices=devices[:world]
            )

    @property
    def axis_name(self) -> str | None:
        """For ``multi_steps``: the axis the window's sums are reduced over."""
        return None if self.strategy == "one_device" else AXIS

    @property
    def grad_axis_name(self) -> str | None:
        """For ``jaxaccum.value_and_grad``: the mesh axis (a vmap lane differentiates
        its own rows: nothing to keep apart)."""
        return AXIS if self.strategy == "jit" else None

    def _context(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _place(self, batch: Any) -> Any:
        """Per-rank numpy leaves ``[R, mb, ...]`` -> what the compiled step takes."""
        if self.strategy == "vmap":
            return jax.tree.map(jnp.asarray, batch)
        rows = jax.tree.map(lambda x: np.reshape(x, (-1,) + x.shape[2:]), batch)
        if self.mesh is None:
            return rows
        return jax.device_put(rows, NamedSharding(self.mesh, P(AXIS)))

    def compile(self, body: Callable, n_scalars: int = 0) -> Callable:
        """``step(params, state, batch, *scalars)`` running ``body`` on the ranks.

        ``batch`` is per rank (numpy leaves ``[R, mb, ...]``); the scalars are the
        same on every rank.
        """
        if self.strategy == "vmap":
            jitted = jax.jit(
                jax.vmap(body, axis_name=AXIS, in_axes=(0, 0, 0) + (None,) * n_scalars)
            )
        else:
            jitted = jax.jit(body)

        def step(params, state, batch, *scalars):
            with self._context():
                return jitted(params, state, self._place(batch), *scalars)

        return step

    def init(self, tx_init: Callable, params: Any) -> tuple[Any, Any]:
        """``(params, tx_init(params))`` laid out for the ranks, in one compiled call."""
        if self.strategy == "vmap":
            stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (self.world,) + x.shape), params)
            return stacked, jax.jit(jax.vmap(tx_init, axis_name=AXIS))(stacked)
        with self._context():
            if self.mesh is not None:
                params = jax.device_put(params, NamedSharding(self.mesh, P()))
            return params, jax.jit(tx_init)(params)

    def host(self, tree: Any) -> Any:
        """One copy of a replicated output, as numpy (a vmap lane stacks R copies)."""
        tree = jax.device_get(tree)
        if self.strategy == "vmap":
            return jax.tree.map(lambda x: np.asarray(x)[0], tree)
        return tree
