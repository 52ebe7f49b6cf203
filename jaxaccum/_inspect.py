"""Reading the optimizer state: did this call update, what was the last window.

Each helper accepts the state of :func:`jaxaccum.multi_steps` or any
optimizer state holding exactly one of it (inside ``optax.chain``, or
``flax.nnx.Optimizer.opt_state``, whose leaves are ``nnx.OptArray``
variables), and returns plain ``jax.Array`` values, eagerly and under
``jit``/``nnx.jit``. :class:`WindowLog` hands the records of the windows that
closed to a logger, as plain numbers, without waiting on any step.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._state import MultiStepsState, WindowMetrics, _one_value


def _find_state(opt_state: Any, caller: str) -> MultiStepsState:
    is_state = lambda x: isinstance(x, MultiStepsState)
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(s)]
    if len(found) != 1:
        raise ValueError(
            f"{caller}: expected exactly one jaxaccum MultiStepsState inside the optimizer"
            f" state; found {len(found)}."
        )
    return found[0]


def _array(leaf: Any) -> jax.Array:
    """A state leaf as a plain array (an ``nnx.Variable`` is a pytree of one array)."""
    (value,) = jax.tree.leaves(leaf)
    return jnp.asarray(value)


def has_updated(opt_state: Any) -> jax.Array:
    """Whether the ``update`` call that returned ``opt_state`` applied an update.

    False between boundaries and after a skipped window.

    Example:
      >>> import jax.numpy as jnp, optax, jaxaccum
      >>> tx = jaxaccum.multi_steps(optax.sgd(1.0), every_k_schedule=2)
      >>> params = {'w': jnp.zeros(2)}
      >>> state = tx.init(params)
      >>> for _ in range(2):
      ...     _, state = tx.update({'w': jnp.ones(2)}, state, params, num_items=1)
      ...     print(bool(jaxaccum.has_updated(state)))
      False
      True
    """
    return _array(_find_state(opt_state, "has_updated").applied)


def loss_scale(opt_state: Any) -> jax.Array:
    """The factor to multiply the summed loss by before differentiating.

    1.0 unless ``multi_steps(..., loss_scaling=DynamicLossScale(...))``. It is
    constant inside a window and changes only at a boundary.
    """
    return _array(_find_state(opt_state, "loss_scale").last_window.loss_scale)


def window_metrics(opt_state: Any) -> WindowMetrics:
    """The :class:`WindowMetrics` of the last closed window.

    Between boundaries it still describes the last closed window; use
    ``._asdict()`` for a logger.

    Example:
      >>> import jax.numpy as jnp, optax, jaxaccum
      >>> tx = jaxaccum.multi_steps(optax.sgd(1.0), every_k_schedule=1)
      >>> params = {'w': jnp.zeros(2)}
      >>> _, state = tx.update({'w': jnp.ones(2)}, tx.init(params), params, num_items=4,
      ...                      loss_sum=2.0)
      >>> metrics = jaxaccum.window_metrics(state)
      >>> int(metrics.update_id), float(metrics.window_items), float(metrics.loss)
      (1, 4.0, 0.5)
    """
    record = _find_state(opt_state, "window_metrics").last_window
    return WindowMetrics(*(_array(field) for field in record))


class WindowLog:
    """The records of closed windows for a logger, read without a host sync per step.

    ``bool(has_updated(state))`` after every micro-step waits for that step to
    finish, which stalls JAX's asynchronous dispatch. Call :meth:`add` after
    every micro-step: it keeps a copy of the state's window record (a few
    scalars, copied on the device, so a step that donates the state may run on;
    their copy to the host started) and returns, as plain numbers
    (:meth:`WindowMetrics.to_python`), the records of the windows closed by the
    calls it was given whose copies are ready: it never waits. Each closed
    window is returned once, applied or skipped; after a resume, a new log given
    the states of the steps that follow (not the restored state itself, which
    holds the record of the window closed before the checkpoint) returns the
    windows they close. A window that closed
    between two calls of :meth:`add` (it was not called after every micro-step)
    cannot be returned: a warning says how many.

    Example:
      >>> import jax.numpy as jnp, optax, jaxaccum
      >>> tx = jaxaccum.multi_steps(optax.sgd(1.0), every_k_schedule=2)
      >>> params = {'w': jnp.zeros(2)}
      >>> state, log, logged = tx.init(params), jaxaccum.WindowLog(), []
      >>> for step in range(4):
      ...     _, state = tx.update({'w': jnp.ones(2)}, state, params, num_items=2, loss_sum=1.0)
      ...     logged += log.add(state)  # whatever is ready; never waits
      >>> logged += log.flush()  # the end of training: wait for the rest
      >>> [(r["update_id"], r["window_items"], r["loss"]) for r in logged]
      [(1, 4.0, 0.5), (2, 4.0, 0.5)]
    """

    def __init__(self) -> None:
        self._pending: collections.deque[tuple[WindowMetrics, jax.Array]] = collections.deque()
        self._closed: int | None = None  # windows closed (applied or skipped) when last seen

    def add(self, opt_state: Any) -> list[dict[str, float | int | bool]]:
        """Keeps a copy of this state's record; returns the closed windows' records that are
        ready (those closed by the calls given to ``add``)."""
        state = _find_state(opt_state, "WindowLog.add")
        kept = _copied((window_metrics(opt_state), _array(state.micro_step)))
        for x in jax.tree.leaves(kept):
            x.copy_to_host_async()
        self._pending.append(kept)
        return self._ready(wait=False)

    def flush(self) -> list[dict[str, float | int | bool]]:
        """Waits for every record kept; returns the closed windows' records."""
        return self._ready(wait=True)

    def _ready(self, wait: bool) -> list[dict[str, float | int | bool]]:
        out = []
        while self._pending and (
            wait or all(x.is_ready() for x in jax.tree.leaves(self._pending[0]))
        ):
            metrics, micro_step = self._pending.popleft()
            record = metrics.to_python()
            closed = record["update_id"] + record["skip_count"]
            if self._closed is not None and closed > self._closed + 1:
                warnings.warn(
                    f"WindowLog: {closed - self._closed - 1} window(s) closed between two calls"
                    " of add and are not in the log: call add after every micro-step",
                    stacklevel=3,
                )
            closed_here = record["micro_step"] == _one_value("micro_step", np.asarray(micro_step))
            if closed_here and (self._closed is None or closed > self._closed):
                out.append(record)
            self._closed = closed
        return out


@jax.jit
def _copied(tree: Any) -> Any:
    """Device copies of a few scalars: a later step that donates the state leaves them be."""
    return jax.tree.map(jnp.copy, tree)
