"""The window normalization: the library's one division by ``num_items``.

The math and why it is the big batch: ``docs/math.md``. The optimizer wrapper
and the in-step scan call :func:`normalize_window`, on sums that the caller has
already added over the devices (the audit's reference, ``bigbatch``, is numpy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class WindowTotals(NamedTuple):
    """A window after normalization.

    Attributes:
      grads: the big-batch gradient ``sum grad(loss_sum) / window_items``, in
        the dtype of the gradient sums (float32 by default). All zeros when the
        window holds no item.
      loss: the window mean loss ``sum loss_sum / window_items``; NaN when the
        window holds no item (there is no mean).
      window_items: the window's number of items ``N``.
      grad_norm: the global L2 norm of ``grads``.
    """

    grads: Any
    loss: jax.Array
    window_items: jax.Array
    grad_norm: jax.Array


def normalize_window(
    grad_sum: Any,
    loss_sum: jax.Array,
    num_items: jax.Array,
    *,
    loss_scale: jax.Array | float = 1.0,
    global_norm: Callable[[Any], jax.Array] = optax.tree.norm,
) -> WindowTotals:
    """Turns a window's sums, added over every device, into the big-batch gradient and loss.

    .. math::

       g = \\frac{\\sum_{r,m} \\nabla \\ell^{sum}_{rm}}{s \\sum_{r,m} n_{rm}},
       \\qquad L = \\frac{\\sum_{r,m} \\ell^{sum}_{rm}}{\\sum_{r,m} n_{rm}}

    over devices ``r`` and micro-batches ``m``, ``s`` the loss scale.

    Args:
      grad_sum: pytree, the window's sum of the gradients of the *summed* (not
        averaged) loss, over all devices.
      loss_sum: scalar, the window's summed loss (unscaled), over all devices.
      num_items: scalar, the window's items (valid tokens, samples, or any
        non-negative weight), over all devices.
      loss_scale: the factor the summed loss was multiplied by before it was
        differentiated (fp16 loss scaling): the gradient is divided by
        ``num_items * loss_scale``, once.
      global_norm: the L2 norm of a gradient pytree (``multi_steps`` passes one
        that adds tensor-parallel blocks over their mesh axes).

    Returns:
      A :class:`WindowTotals`. A window of 0 items (or less) gets a zero
      gradient and a NaN loss rather than ``0/0``; callers decide whether to
      skip it (the optimizer wrapper does).

    Example:
      >>> import jax.numpy as jnp
      >>> totals = normalize_window({'w': jnp.array(8.0)}, jnp.array(4.0), jnp.array(4.0))
      >>> float(totals.grads['w']), float(totals.loss)
      (2.0, 1.0)
    """
    has_items = num_items > 0
    denominator = jnp.where(has_items, num_items, jnp.ones_like(num_items))
    grad_denominator = denominator * jnp.asarray(loss_scale).astype(denominator.dtype)

    def divide(g):  # in the wider of the two dtypes: a bf16 N would round 120004 to 120320
        wide = max(g.dtype, grad_denominator.dtype, key=lambda d: d.itemsize)
        quotient = g.astype(wide) / grad_denominator.astype(wide)
        return jnp.where(has_items, quotient, 0).astype(g.dtype)

    grads = jax.tree.map(divide, grad_sum)
    loss = jnp.where(has_items, loss_sum / denominator, jnp.nan).astype(loss_sum.dtype)
    return WindowTotals(
        grads=grads, loss=loss, window_items=num_items, grad_norm=global_norm(grads)
    )


def clip_by_global_norm(
    grads: Any, grad_norm: jax.Array, max_grad_norm: float | None
) -> tuple[Any, jax.Array]:
    """Clips a window gradient to ``max_grad_norm``, PyTorch's formula.

    ``coef = min(1, max_grad_norm / (grad_norm + 1e-6))`` as in
    ``torch.nn.utils.clip_grad_norm_``, so both frameworks clip identically.

    Returns:
      ``(clipped grads, norm after clipping)``.
    """
    if max_grad_norm is None:
        return grads, grad_norm
    coef = jnp.minimum(1.0, max_grad_norm / (grad_norm + 1e-6)).astype(grad_norm.dtype)
    return jax.tree.map(lambda g: g * coef.astype(g.dtype), grads), grad_norm * coef
