"""The window normalization: the one place where the big-batch math happens.

An optimizer update ("window") is built from ``k`` micro-batches on each of
``R`` devices. With ``l_rmt`` the loss of item ``t`` (a valid token, or a
sample) of micro-batch ``m`` on device ``r``, the big-batch loss is::

    L = sum_{r,m,t} l_rmt / N,        N = number of items in the window

and its gradient is ``sum_{r,m} grad(sum_t l_rmt) / N``. So every path
accumulates three SUMS per device (gradient of the summed loss, summed loss,
``num_items``) and, at the window boundary only, adds them across devices
once and divides once. Dividing earlier (a mean per micro-batch, or a mean per
device) weighs items unequally: that is the "mean of means" and the "local
denominator" bug (``docs/math.md``).

:func:`normalize_window` is the library's one division by ``num_items``; the
optimizer wrapper, the in-step scan and the audit all call it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxaccum._sharding import global_norm, reduce_over_devices


class WindowTotals(NamedTuple):
    """A window after normalization.

    Attributes:
      grads: the big-batch gradient ``sum grad(loss_sum) / window_items``, in
        the dtype of the gradient sums (float32 by default). All zeros when the
        window holds no item.
      loss: the window mean loss ``sum loss_sum / window_items``; NaN when the
        window holds no item (there is no mean).
      window_items: the global number of items ``N`` (summed over devices).
      grad_norm: the global L2 norm of ``grads`` (over every block of a
        tensor-parallel leaf under ``shard_map``).
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
    axis_name: str | tuple[str, ...] | None = None,
    loss_scale: jax.Array | float = 1.0,
) -> WindowTotals:
    """Turns a window's sums into the big-batch gradient and loss, once.

    .. math::

       g = \\frac{\\mathrm{psum}(\\sum_m \\nabla \\ell^{sum}_m)}{\\mathrm{psum}(\\sum_m n_m)},
       \\qquad L = \\frac{\\mathrm{psum}(\\sum_m \\ell^{sum}_m)}{\\mathrm{psum}(\\sum_m n_m)}

    Args:
      grad_sum: pytree, this device's sum over the window of the gradients of
        the *summed* (not averaged) loss.
      loss_sum: scalar, this device's summed loss over the window.
      num_items: scalar, this device's number of items (valid tokens, samples,
        or any non-negative weight) over the window.
      axis_name: the mesh axis the batch is split over (``pmap`` or
        ``shard_map``): the three sums are added over it in one collective.
        ``None`` when the sums are already global (one device, or ``jit`` over
        globally sharded arrays).
      loss_scale: the factor the summed loss was multiplied by before it was
        differentiated (fp16 loss scaling); the gradient is divided by
        ``window_items * loss_scale``, once. ``loss_sum`` is the unscaled loss.

    Returns:
      A :class:`WindowTotals`. A window with a global ``num_items`` of 0 (or
      less) gets a zero gradient and a NaN loss rather than ``0/0``; callers
      decide whether to skip it (the optimizer wrapper does).

    Example:
      >>> import jax.numpy as jnp
      >>> totals = normalize_window({'w': jnp.array(8.0)}, jnp.array(4.0), jnp.array(4.0))
      >>> float(totals.grads['w']), float(totals.loss)
      (2.0, 1.0)
    """
    grad_sum, loss_sum, num_items = reduce_over_devices((grad_sum, loss_sum, num_items), axis_name)
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
