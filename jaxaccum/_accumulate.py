"""`accumulate_gradients`: the in-step variant, one jitted step over k micro-batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _sharding
from jaxaccum._check_batch import ACCUMULATE, batch_split
from jaxaccum._explicit_grad import batch_only_mesh, gather
from jaxaccum._grad import nnx_of
from jaxaccum._grad import value_and_grad as jaxaccum_value_and_grad
from jaxaccum._normalize import normalize_window
from jaxaccum._sharding import Placement
from jaxaccum._state import items_dtype_for


def accumulate_gradients(
    loss_fn: Callable[[Any, Any], tuple[jax.Array, jax.Array]],
    params: Any,
    microbatches: Any,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    accumulator_dtype: Any = jnp.float32,
) -> tuple[Any, dict[str, jax.Array]]:
    """The big-batch gradient of ``k`` micro-batches, inside one step.

    ``lax.scan`` runs over the leading axis of ``microbatches``; each iteration
    adds the gradient of the micro-batch's SUMMED loss, the summed loss and its
    ``num_items`` to three running sums (in ``accumulator_dtype``). After the
    scan the sums go through the same :func:`~jaxaccum.normalize_window` as
    :func:`jaxaccum.multi_steps`: one ``psum`` over ``axis_name`` (when given),
    one division. Only one micro-batch's activations are alive at a time.
    Typed PRNG keys in ``microbatches`` draw one stream per device, as in
    :func:`jaxaccum.value_and_grad`.

    Args:
      loss_fn: ``loss_fn(params, microbatch) -> (loss_sum, num_items)``: the
        summed loss (differentiated) and the number of items it adds up (not
        differentiated), e.g. :func:`jaxaccum.losses.causal_lm`.
      params: the parameters, a pytree (a ``flax.nnx.Module`` is refused: pass
        its ``nnx.Param`` state from ``nnx.split`` and merge it in ``loss_fn``).
      microbatches: pytree whose leaves have a leading micro-batch axis ``k``,
        then the rows: on a mesh, split the rows over ``axis_name``
        (``P(None, "data")``). A split micro-batch axis (``P("data")``) gives
        the same sums, but each device then scans its ``k / devices``
        micro-batches of every row: as many activations per device as the
        unsplit rows.
      axis_name: the mesh axis the batch is split over (``jax.jit`` on an
        Explicit mesh, ``shard_map`` or ``pmap``), or ``None`` (one device, or
        ``jit`` with the partitioner reducing each micro-batch).
      accumulator_dtype: dtype of the gradient sums; the loss and the items
        are summed in float32 (float64 with float64 sums) whatever it is.

    Returns:
      ``(grads, metrics)``: the window gradient in the parameters' dtypes, and
      ``{'loss', 'window_items', 'grad_norm'}`` (global, replicated). An empty
      window (global ``num_items`` 0) gives zero gradients and a NaN loss.

    Example:
      >>> import jax, jax.numpy as jnp, jaxaccum
      >>> loss_fn = lambda p, b: (jnp.sum(b['n'] * (p - b['y']) ** 2), jnp.sum(b['n']))
      >>> batches = {'y': jnp.array([1.0, 5.0]), 'n': jnp.array([3.0, 1.0])}
      >>> grads, metrics = jaxaccum.accumulate_gradients(loss_fn, jnp.array(0.0), batches)
      >>> float(grads), float(metrics['loss'])  # (3 * -2 + 1 * -10) / 4, (3 * 1 + 25) / 4
      (-4.0, 7.0)
    """
    _refuse_module(params)
    placement = _sharding.placement(axis_name)
    batch_split(microbatches, axis_name, ACCUMULATE)  # [k, rows, ...] leaves, rows split
    if placement is Placement.EXPLICIT and batch_only_mesh(axis_name):
        # under jit, every mesh axis a batch axis: the per-device scan in a shard_map
        def per_device(params, microbatches):
            return _window(loss_fn, params, microbatches, axis_name, accumulator_dtype)

        gathered = jax.tree.map(gather, params)  # FSDP leaves: all-gathered
        in_specs = (
            jax.tree.map(lambda _: jax.P(), params),
            jax.tree.map(_sharding.spec_of, microbatches),
        )
        totals = jax.shard_map(per_device, in_specs=in_specs, out_specs=jax.P())(
            gathered, microbatches
        )
        totals = totals._replace(grads=jax.tree.map(_sharding.like, totals.grads, params))
    else:
        totals = _window(loss_fn, params, microbatches, axis_name, accumulator_dtype)
    grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), totals.grads, params)
    metrics = {
        "loss": totals.loss,
        "window_items": totals.window_items,
        "grad_norm": totals.grad_norm,
    }
    return grads, metrics


def _refuse_module(params: Any) -> None:
    """A ``flax.nnx.Module`` is not a pytree of parameters: name the split that makes one."""
    if nnx_of(params) is not None:
        raise TypeError(
            "accumulate_gradients: `params` must be a pytree of parameters; got a"
            f" flax.nnx.Module ({type(params).__name__}). Split it: graphdef, params, rest ="
            " nnx.split(model, nnx.Param, ...), and pass lambda p, mb:"
            " loss_fn(nnx.merge(graphdef, p, rest), mb) with params; the gradients are an"
            " nnx.State for optimizer.update(model, grads). For a loss that updates the"
            " module's own state (a dropout count, batch statistics) use multi_steps with"
            " jaxaccum.value_and_grad."
        )


def _window(loss_fn, params, microbatches, axis_name, accumulator_dtype):
    """The scan over the micro-batches, the one reduction and the window's normalization.

    Each micro-batch is differentiated per device (:func:`jaxaccum.value_and_grad`),
    so the only reduction is the one after the scan.
    """
    placement = _sharding.placement(axis_name)
    value_and_grad = jaxaccum_value_and_grad(loss_fn, axis_name=axis_name)
    items_dtype = items_dtype_for(accumulator_dtype)  # counts stay exact

    def add_microbatch(sums, microbatch):
        grad_sum, loss_sum, num_items = sums
        (mb_loss, mb_items), mb_grads = value_and_grad(params, microbatch)
        grad_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, mb_grads)
        as_sum = lambda x: jnp.asarray(x).astype(items_dtype)
        return (grad_sum, loss_sum + as_sum(mb_loss), num_items + as_sum(mb_items)), None

    def grad_zero(p):
        zeros = jnp.zeros(jnp.shape(p), accumulator_dtype)
        if placement is Placement.EXPLICIT:  # partial sums, unreduced over the axis
            return jax.reshard(zeros, _sharding.unreduced_spec(p, axis_name))
        return zeros

    zero = jnp.zeros((), items_dtype)
    zeros = (jax.tree.map(grad_zero, params), zero, zero)
    if placement is Placement.PER_DEVICE:
        # The sums vary across devices: declare it, so the scan carry type is stable.
        zeros = jax.tree.map(lambda x: jax.lax.pcast(x, axis_name, to="varying"), zeros)
    sums, _ = jax.lax.scan(add_microbatch, zeros, microbatches)
    grad_sum, loss_sum, num_items = _sharding.reduce_over_devices(sums, axis_name)
    return normalize_window(grad_sum, loss_sum, num_items, global_norm=_sharding.global_norm)
