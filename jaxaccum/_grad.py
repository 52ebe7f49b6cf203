"""`value_and_grad`: the gradient multi_steps expects, in one call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def value_and_grad(
    loss_fn: Callable[..., tuple[jax.Array, jax.Array]],
    *,
    axis_name: str | tuple[str, ...] | None = None,
) -> Callable[..., tuple[tuple[jax.Array, jax.Array], Any]]:
    """Wraps ``loss_fn(params, *args) -> (loss_sum, num_items)`` for accumulation.

    The returned function ``f(params, *args, loss_scale=1.0)`` gives
    ``((loss_sum, num_items), grads)`` where ``grads`` is the gradient of
    ``loss_scale * loss_sum`` and ``loss_sum`` is unscaled: exactly what
    ``multi_steps(...).update`` takes. With ``axis_name`` (inside ``shard_map``)
    the parameters are first marked as varying per device, so each device keeps
    its own gradient and no collective runs before the window boundary (JAX's
    autodiff would otherwise sum the gradient over the axis at every call).

    Example:
      >>> import jax.numpy as jnp
      >>> f = value_and_grad(lambda w, n: (n * w ** 2, n))
      >>> (loss_sum, num_items), grad = f(jnp.array(3.0), 2.0, loss_scale=4.0)
      >>> float(loss_sum), float(num_items), float(grad)  # grad of 4 * 2 * w^2 at 3
      (18.0, 2.0, 48.0)
    """

    def scaled_loss(params, *args, loss_scale):
        loss_sum, num_items = loss_fn(params, *args)
        return loss_sum * jnp.asarray(loss_scale, loss_sum.dtype), (loss_sum, num_items)

    grad_fn = jax.grad(scaled_loss, has_aux=True)

    def wrapped(params, *args, loss_scale: Any = 1.0):
        if axis_name is not None:
            params = jax.lax.pcast(params, axis_name, to="varying")
        grads, (loss_sum, num_items) = grad_fn(params, *args, loss_scale=loss_scale)
        return (loss_sum, num_items), grads

    return wrapped
