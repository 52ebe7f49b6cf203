"""`jaxaccum.audit.check_big_batch`: one window of your loop against the big batch, by hand.

The comparison that tells (``docs/audit.md``, "Checking the big batch
yourself"): one window's SGD update against the SGD step of one batch holding
all the window's rows, whose gradient is that of the mean over all its items,
clipped once with PyTorch's formula. Not AdamW's parameters: where a
parameter's exact gradient is zero, Adam turns float32 noise into a step of
about its learning rate.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

import bigbatch
from jaxaccum._audit_window import _check_sums, _row_values, params_rounding

BIG_BATCH_RTOL = 1e-4
"""The default tolerance on the relative difference, for float32 parameters and gradients:
the same per-item gradients added in another order (the window's partial sums, then the
devices) differ from the big batch's by rounding, measured 2e-7 to 3e-7 on a window of 925
tokens on 8 devices, and up to 2.8e-5 read back as new minus old parameters at a learning
rate of 0.1 (``jaxaccum/_big_batch_check_test.py``; ``BigBatchCheck.readback``); a bug moves
the update by a few percent at least (a uniform scale error by a factor of R or k). Widen it
for bf16 or fp16 compute."""


class BigBatchCheck(NamedTuple):
    """One window's update against the big batch's.

    Attributes:
      relative_error: ``|u - u_big| / |u_big|`` over all parameters.
      rtol: the tolerance it was held to.
      passed: ``relative_error <= rtol``.
      scale: your update along the big batch's direction, in units of it
        (``<u, u_big> / |u_big|^2``): 1 for the big batch; a uniform scale error
        (a count R or k times too large, a missing 1/k) shows as R, k, 1/R...
      window_items: the window's items (``num_items`` over all its rows).
      grad_norm: the big batch's gradient norm, before clipping.
      big_batch_update: the big batch's SGD update, a pytree like ``params``.
      readback: how far an update read back as new minus old parameters can be off by
        the new parameters' rounding alone, relative to the big batch's update (half an
        ulp of each parameter, L2; measured errors are 0.1 to 0.5 of it): above ``rtol``,
        such an update may fail; the update your optimizer returned has no such error.
    """

    relative_error: float
    rtol: float
    passed: bool
    scale: float
    window_items: float
    grad_norm: float
    big_batch_update: Any
    readback: float

    def __str__(self) -> str:
        head = "PASSED" if self.passed else "FAILED"
        unreadable = (
            f"; new minus old parameters read this update only to {self.readback:.1e}: pass"
            " the update your optimizer returned, or use a larger learning_rate"
            if self.readback > self.rtol and not self.passed
            else ""
        )
        return (
            f"{head}: your update is {self.relative_error:.2e} (relative) from the big batch's"
            f" (rtol {self.rtol:.0e}); along its direction it is {self.scale:.4g}x;"
            f" {self.window_items:g} items, gradient norm {self.grad_norm:.4g} before clipping"
            + unreadable
        )


def check_big_batch(
    update: Any,
    loss_fn: Callable[[Any, Any], tuple[jax.Array, jax.Array]],
    params: Any,
    microbatches: Sequence[Any],
    *,
    learning_rate: float = 1.0,
    max_grad_norm: float | None = None,
    rtol: float = BIG_BATCH_RTOL,
) -> BigBatchCheck:
    """Compares one window's SGD update with the big batch's, within ``rtol``.

    .. math::

       u_{big} = -lr \\cdot \\mathrm{clip}\\Big(\\nabla \\frac{\\sum_{i} \\ell_i}{N}\\Big),
       \\qquad \\frac{|u - u_{big}|}{|u_{big}|} \\le rtol

    over the items ``i`` of all the window's micro-batches on all devices,
    clipped once to ``max_grad_norm`` with PyTorch's formula
    (``max / (norm + 1e-6)``, as ``multi_steps`` clips; optax's
    ``clip_by_global_norm`` has no ``1e-6``).

    Args:
      update: your loop's parameter change over one window, run with
        ``optax.sgd(learning_rate)`` as the inner optimizer (SGD's step is the
        gradient itself, where AdamW's is not: see the module docstring). Pass
        the updates your optimizer returned at the boundary: new minus old
        parameters adds their float32 rounding (``BigBatchCheck.readback``).
      loss_fn: ``loss_fn(params, batch) -> (loss_sum, num_items)``, a SUM over the
        batch's items and their number.
      params: the parameters the window started from.
      microbatches: the window's micro-batches, each with every device's rows:
        ``loss_fn`` runs on each (one at a time in memory), their gradients are
        added in float64 and divided once by the window's items.
      learning_rate: the SGD learning rate of your run.
      max_grad_norm: your clip threshold, or ``None`` (no clip).
      rtol: the tolerance (:data:`BIG_BATCH_RTOL`, for float32).

    Raises:
      ValueError: an argument out of its range (each error names it), a window
        without items, a ``loss_fn`` that does not add up over the rows of the
        first micro-batch (a mean), or an update not shaped like ``params``.

    Returns:
      A :class:`BigBatchCheck`; ``print`` it for one line.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxaccum
      >>> loss_fn = lambda p, b: (jnp.sum(b["n"] * (p["w"] - b["t"]) ** 2), jnp.sum(b["n"]))
      >>> params = {"w": jnp.array(0.0)}
      >>> microbatches = [{"t": jnp.array([1.0]), "n": jnp.array([3.0])},
      ...                 {"t": jnp.array([5.0]), "n": jnp.array([1.0])}]
      >>> mean_of_means = {"w": jnp.array(6.0)}  # (2 * 1 + 2 * 5) / 2: each micro-batch's mean
      >>> check = jaxaccum.audit.check_big_batch(mean_of_means, loss_fn, params, microbatches)
      >>> check.passed, float(check.big_batch_update["w"]), round(check.scale, 3)
      (False, 4.0, 1.5)
    """
    _check(microbatches, learning_rate, rtol)
    max_grad_norm = bigbatch.check_max_grad_norm(max_grad_norm)
    first = microbatches[0]  # a sum over rows, or the big batch is not one (a mean: refused)
    _check_sums(loss_fn, params, first, *_row_values(loss_fn, params, first))
    big, window_items, grad_norm = _big_batch_update(
        loss_fn, params, microbatches, learning_rate, max_grad_norm
    )
    if jax.tree.structure(update) != jax.tree.structure(big):
        raise ValueError(
            "update: expected a pytree like params (your window's updates, the parameter change);"
            f" got {jax.tree.structure(update)}, params are {jax.tree.structure(big)}"
        )
    ours = np.concatenate([np.asarray(u, np.float64).ravel() for u in jax.tree.leaves(update)])
    theirs = np.concatenate([b.ravel() for b in jax.tree.leaves(big)])
    reference = float(np.linalg.norm(theirs))
    if reference == 0.0:
        raise ValueError(
            "loss_fn: the big batch's gradient is zero here: there is no update to compare"
        )
    relative = float(np.linalg.norm(ours - theirs)) / reference
    scale = float(ours @ theirs) / reference**2
    readback = params_rounding(params) / 2 / reference  # half an ulp of each parameter
    return BigBatchCheck(
        relative, rtol, relative <= rtol, scale, window_items, grad_norm, big, readback
    )


def _check(microbatches: Sequence[Any], learning_rate: float, rtol: float) -> None:
    if not isinstance(microbatches, Sequence) or not microbatches:
        raise ValueError(
            "microbatches: expected the window's micro-batches as a non-empty list, got"
            f" {type(microbatches).__name__}"
        )
    for value, name in ((learning_rate, "learning_rate"), (rtol, "rtol")):
        if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")


def _big_batch_update(loss_fn, params, microbatches, learning_rate, max_grad_norm):
    """SGD's step on the window's mean loss, clipped once, in float64: the gradients of the
    micro-batches' SUMMED losses added, divided once by the window's items (one micro-batch
    in memory at a time). Returns the update (a pytree like ``params``), the items, the norm."""
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    total, window_items = None, 0.0
    for microbatch in microbatches:
        (_, num_items), grads = grad_fn(params, microbatch)
        leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
        total = leaves if total is None else [t + g for t, g in zip(total, leaves, strict=True)]
        window_items += float(num_items)
    if not window_items > 0:
        raise ValueError(
            f"microbatches: the window holds no item (num_items adds up to {window_items})"
        )
    grads = [t / window_items for t in total]
    grad_norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads))
    # PyTorch's clip_grad_norm_, as multi_steps clips (written out: no jaxaccum code here)
    coef = 1.0 if max_grad_norm is None else min(1.0, max_grad_norm / (grad_norm + 1e-6))
    update = [-learning_rate * coef * g for g in grads]
    return jax.tree.unflatten(jax.tree.structure(params), update), window_items, grad_norm
