"""The window normalization: the one place where the big-batch math happens.

An optimizer update ("window") is built from ``k`` micro-batches on each of
``R`` devices. With ``l_rmt`` the loss of unit ``t`` (a valid token, or a
sample) of micro-batch ``m`` on device ``r``, the big-batch loss is::

    L = sum_{r,m,t} l_rmt / N,        N = number of loss units in the window

and its gradient is ``sum_{r,m} grad(sum_t l_rmt) / N``. So every path
accumulates three SUMS per device (gradient of the summed loss, summed loss,
count of units) and, at the window boundary only, adds them across devices
once (one ``psum``) and divides once. Dividing earlier (a mean per micro-batch,
or a mean per device) weighs units unequally: that is the "mean of means" and
the "local denominator" bug.

Every code path (the optimizer wrapper, the in-step scan, the examples) calls
:func:`normalize_window`; nothing else divides by a count.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class WindowTotals(NamedTuple):
    """A window after normalization.

    Attributes:
      grads: the big-batch gradient ``sum grad(loss_sum) / window_count``, in
        the dtype of the gradient sums (float32 by default). All zeros when the
        window holds no loss unit.
      loss: the window mean loss ``sum loss_sum / window_count`` (0 when empty).
      window_count: the global number of loss units ``N`` (summed over devices).
      grad_norm: the global L2 norm of ``grads``.
    """

    grads: Any
    loss: jax.Array
    window_count: jax.Array
    grad_norm: jax.Array


def normalize_window(
    grad_sum: Any,
    loss_sum: jax.Array,
    count: jax.Array,
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
      count: scalar, this device's number of loss units (valid tokens, samples,
        or any non-negative weight) over the window.
      axis_name: the mapped axis (``pmap``/``shard_map``) to add the three sums
        over, in one ``psum``. ``None`` when the sums are already global (one
        device, or ``jit`` over globally sharded arrays).
      loss_scale: the factor the summed loss was multiplied by before it was
        differentiated (fp16 loss scaling); the gradient is divided by
        ``window_count * loss_scale``, once. ``loss_sum`` is the unscaled loss.

    Returns:
      A :class:`WindowTotals`. A window with a global count of 0 (or less) gets
      zero gradient and zero loss rather than ``0/0``; callers decide whether to
      skip it (the optimizer wrapper does).

    Example:
      >>> import jax.numpy as jnp
      >>> totals = normalize_window({'w': jnp.array(8.0)}, jnp.array(4.0), jnp.array(4.0))
      >>> float(totals.grads['w']), float(totals.loss)
      (2.0, 1.0)
    """
    if axis_name is not None:
        # One collective for the whole window: the three sums travel together.
        grad_sum, loss_sum, count = jax.lax.psum((grad_sum, loss_sum, count), axis_name)
    has_units = count > 0
    denominator = jnp.where(has_units, count, jnp.ones_like(count))
    grad_denominator = denominator * loss_scale
    grads = jax.tree.map(
        lambda g: jnp.where(has_units, g / grad_denominator.astype(g.dtype), 0).astype(g.dtype),
        grad_sum,
    )
    loss = jnp.where(has_units, loss_sum / denominator, 0).astype(loss_sum.dtype)
    return WindowTotals(
        grads=grads,
        loss=loss,
        window_count=count,
        grad_norm=optax.tree.norm(grads),
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
