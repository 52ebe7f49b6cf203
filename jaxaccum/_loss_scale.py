"""fp16 dynamic loss scaling: PyTorch ``GradScaler``'s schedule per window, and the backward
pass's scale, sized like GradScaler's on a mean loss."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum._check_values import scalar
from jaxaccum._state import at_least_float32


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """fp16 dynamic loss scaling per window, PyTorch ``GradScaler``'s schedule.

    The scale is constant inside a window. At the boundary the gradient is
    unscaled once; a non-finite window is skipped and the scale multiplied by
    ``backoff_factor``; after ``growth_interval`` consecutive applied windows it
    is multiplied by ``growth_factor`` (kept as is if that would overflow
    float32). Empty windows change nothing. See ``next_loss_scale``.

    Attributes:
      init_scale: the first scale (PyTorch's default 2**16).
      growth_factor: > 1.
      backoff_factor: in (0, 1).
      growth_interval: applied windows between growths, >= 1.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        def check(name, kind, expected, ok):
            where = "DynamicLossScale"
            scalar(getattr(self, name), name, where=where, kind=kind, expected=expected, ok=ok)

        finite_in_float32 = lambda v: np.isfinite(np.float32(v)) and v > 0
        with np.errstate(over="ignore"):  # 1e39 -> inf in float32 is the point of the check
            check("init_scale", "real", "a finite float32 number > 0", finite_in_float32)
        check("growth_factor", "real", "a finite number > 1", lambda v: np.isfinite(v) and v > 1)
        check("backoff_factor", "real", "a number in (0, 1)", lambda v: 0 < v < 1)
        check("growth_interval", "int", "an int >= 1", lambda v: v >= 1)


def next_loss_scale(
    config: DynamicLossScale | None,
    scale: jax.Array,
    good_windows: jax.Array,
    *,
    applied: jax.Array,
    overflow: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The loss scale and growth tracker after one window.

    PyTorch's ``GradScaler.update`` with one window for one step: an overflow
    (a non-finite gradient; a non-finite loss or ``num_items`` is no smaller
    scale's to cure: the window is skipped, the scale kept) multiplies the scale
    by ``backoff_factor`` and resets
    the tracker; an applied window adds one to the tracker, and when it reaches
    ``growth_interval`` the scale is multiplied by ``growth_factor`` (unless
    that is not finite in float32) and the tracker resets. A window that is
    neither (an empty one) changes nothing.

    Args:
      config: the schedule, or None (no loss scaling: the scale is 1 from the
        next window on, even where a restored state held another).
      scale: float32, the scale the window was computed with.
      good_windows: int32, applied windows since the scale last changed.
      applied: bool, the window was applied.
      overflow: bool, the window's gradient was not finite.

    Returns:
      ``(scale, good_windows)`` for the next window.

    Example:
      >>> import jax.numpy as jnp
      >>> config = DynamicLossScale(init_scale=8.0, growth_interval=2)
      >>> state = (jnp.float32(8.0), jnp.int32(0))
      >>> for applied, overflow in [(True, False), (True, False), (False, True)]:
      ...     state = next_loss_scale(config, *state, applied=applied, overflow=overflow)
      ...     print(float(state[0]), int(state[1]))
      8.0 1
      16.0 0
      8.0 0
    """
    if config is None:  # a state saved with loss scaling: its open window was scaled, no later one
        return jnp.ones_like(scale, jnp.float32), good_windows
    applied, overflow = jnp.asarray(applied), jnp.asarray(overflow)
    tracker = good_windows + applied.astype(jnp.int32)
    grown = (scale * config.growth_factor).astype(jnp.float32)
    grow = applied & (tracker >= config.growth_interval)
    new_scale = jnp.where(grow & jnp.isfinite(grown), grown, scale)
    new_scale = jnp.where(overflow, scale * config.backoff_factor, new_scale)
    new_tracker = jnp.where(overflow | grow, 0, tracker)
    return new_scale.astype(jnp.float32), new_tracker.astype(jnp.int32)


# -- The backward pass's scale, sized like GradScaler's on a mean loss.


def scaled_loss(loss_sum: jax.Array, num_items: Any, loss_scale: Any) -> jax.Array:
    """What the backward pass differentiates: ``loss_sum`` times ``loss_scale / n``.

    ``n`` (this micro-batch's items, at least 1, not differentiated) makes the
    values in the low-precision backward pass the size of GradScaler's on a
    mean loss: a summed loss's gradient is ``n`` times a mean's, and at the
    same scale it would overflow about ``log2(n)`` windows longer.
    ``loss_scale=None``: the summed loss as it is.
    """
    if loss_scale is None:
        return loss_sum
    return loss_sum * jax.lax.stop_gradient(_backward_factor(num_items, loss_scale, loss_sum))


def unscaled_to_sum(grads: Any, num_items: Any, loss_scale: Any, loss_sum: jax.Array) -> Any:
    """The gradient of :func:`scaled_loss` turned into that of ``loss_scale * loss_sum``.

    Multiplied by ``loss_scale / factor`` (``factor`` as the backward pass used
    it, in the loss's dtype) in float32 or wider: the summed loss's gradient,
    ``n`` times a mean's, can exceed float16's range where the mean's did not.
    An overflow of the backward pass stays inf and skips the window.
    """
    if loss_scale is None:
        return grads
    factor = _backward_factor(num_items, loss_scale, loss_sum)
    wide = at_least_float32(loss_sum.dtype)
    undo = jnp.asarray(loss_scale, wide) / factor.astype(wide)

    def to_sum(g):
        g_wide = at_least_float32(g.dtype)
        return g.astype(g_wide) * undo.astype(g_wide)

    return jax.tree.map(to_sum, grads)


def _backward_factor(num_items: Any, loss_scale: Any, loss_sum: jax.Array) -> jax.Array:
    """``loss_scale / max(n, 1)``, computed in float32 (or float64), in the loss's dtype, at
    most its largest finite value: a float16 loss of a micro-batch with 0 or 1 items at the
    default scale 2**16 would take an infinite factor (0 * inf: a NaN gradient that skips
    the window). :func:`unscaled_to_sum` undoes the factor as used."""
    wide = at_least_float32(loss_sum.dtype)
    items = jnp.maximum(jnp.asarray(num_items).astype(wide), 1.0)
    factor = jnp.asarray(loss_scale, wide) / items
    return jnp.minimum(factor, float(jnp.finfo(loss_sum.dtype).max)).astype(loss_sum.dtype)
