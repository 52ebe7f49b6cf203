"""The state of :func:`jaxaccum.multi_steps` and the record of a closed window."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from bigbatch import SkipReason


class WindowMetrics(NamedTuple):
    """What the last closed window was (scalars, identical on every device).

    Between boundaries it still describes the last closed window. ``_asdict()``
    gives a dict for loggers; the keys are those of ``torch_ref``'s records.

    Attributes:
      micro_step: int32, micro-batches seen on this device since ``init``, at
        the end of the window.
      update_id: int32, updates applied since ``init`` (after this window).
        Skipped windows do not count; the inner optimizer counts the same.
      window_items: the window's global ``num_items`` ``N``: items of all its
        micro-batches on all devices (float32, float64 with float64 sums):
        exact while it is below 2**24 (16,777,216) in float32.
      cumulative_items: ``N`` summed over every applied window, in the same
        dtype: exact below 2**24 in float32, then to float32's rounding, which
        adds up over windows (measured: 9e-5 relative after 20,000 windows of
        2,000,003 items). For a long run's token count, add ``window_items``
        up on the host (``WindowLog``) or enable float64.
      loss: the window's mean loss ``sum(loss_sum) / N``; NaN when it has no
        value: ``loss_sum`` was not passed on every call of the window, or the
        window was empty. A non-finite window records what it computed.
      grad_norm: the L2 norm of the window gradient (``grad_sum / N``),
        before clipping; unscaled by the loss scale.
      grad_norm_clipped: the norm after clipping (``grad_norm`` without it, and
        for a non-finite window: nothing was clipped).
      skipped: bool, the window was dropped: no parameter change, the inner
        optimizer did not advance.
      skip_count: int32, windows skipped since ``init``.
      skip_reason: int32, a :class:`SkipReason`.
      loss_scale: float32, the loss scale of the NEXT window (1 without loss
        scaling).
    """

    micro_step: jax.Array
    update_id: jax.Array
    window_items: jax.Array
    cumulative_items: jax.Array
    loss: jax.Array
    grad_norm: jax.Array
    grad_norm_clipped: jax.Array
    skipped: jax.Array
    skip_count: jax.Array
    skip_reason: jax.Array
    loss_scale: jax.Array

    def to_python(self) -> dict[str, float | int | bool]:
        """The record as plain Python numbers, for a logger: one transfer of all fields.

        Counters come back as ``int``, ``skipped`` as ``bool``, the rest as ``float``.
        Reading them waits for the step that made them; :class:`jaxaccum.WindowLog`
        reads them once they are ready instead. A state with one copy per device
        (``pmap``'s) is read once: its copies must agree, as a window's record does.
        """
        host = jax.device_get([_one_copy(x) for x in self])
        return {
            name: _PYTHON_TYPE.get(name, float)(_one_value(name, value))
            for name, value in zip(self._fields, host, strict=True)
        }


def _one_value(name: str, value: Any) -> Any:
    """A field as one number: a scalar, or the common value of its copies (one per device)."""
    copies = np.ravel(value)
    if copies.size == 0 or not np.array_equal(
        copies, np.full_like(copies, copies[0]), equal_nan=True
    ):
        raise ValueError(
            f"WindowMetrics.to_python: {name} differs between its copies ({copies.tolist()});"
            " a window's record is the same on every device after its reduction: pass the"
            " state of one run (a vmap of several runs holds one record each)"
        )
    return copies[0].item()


_PYTHON_TYPE = dict(micro_step=int, update_id=int, skip_count=int, skip_reason=int, skipped=bool)


def _one_copy(x: Any) -> Any:
    """A replicated value as this process can read it: itself, or (several hosts) its copy on
    this process's first device."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.addressable_data(0)
    return x


class MultiStepsState(NamedTuple):
    """State of :func:`jaxaccum.multi_steps`.

    The window sums (``grad_sum``, ``loss_sum``, ``num_items``) belong to one
    device between boundaries. With an ``axis_name`` they hold one row per
    device: the global array has a leading axis sharded over the batch axis
    (``P(axis_name, *param_spec)``, see :func:`jaxaccum.partition_specs`); under
    ``shard_map`` or ``pmap`` each device sees its row as a leading axis of
    length 1. Under ``jit`` on an Explicit mesh a parameter sharded over the
    batch axis (FSDP) is the exception: its sum is kept sharded like it. So the
    state is an ordinary pytree of ordinary arrays on every route (Orbax saves
    it, ``jax.device_get`` reads it). Every other leaf is identical on every
    device. The counters that outlive a window (the update
    id, the cumulative items, the skip count, the loss scale) live in
    ``last_window`` only.

    Attributes:
      window_step: int32, micro-batches accumulated in the open window.
      micro_step: int32, micro-batches seen since ``init``.
      good_windows: int32, applied windows since the loss scale last changed
        (PyTorch ``GradScaler``'s growth tracker).
      loss_known: bool, every call of the open window passed ``loss_sum``.
      applied: bool, whether the call that returned this state applied an
        update.
      inner_state: the inner optimizer's state.
      grad_sum: the open window's sum of the gradients of the SUMMED loss
        (``accumulator_dtype``, float32 by default).
      loss_sum: the open window's summed loss (float32 whatever
        ``accumulator_dtype`` is; float64 with float64 sums).
      num_items: the open window's items: valid tokens, samples, or any
        non-negative weight (float32, float64 with float64 sums, whatever
        ``accumulator_dtype`` is: whole counts are exact below 2**24).
      last_window: the :class:`WindowMetrics` of the last closed window; its
        ``update_id`` is what ``every_k_schedule`` sees.
    """

    window_step: jax.Array
    micro_step: jax.Array
    good_windows: jax.Array
    loss_known: jax.Array
    applied: jax.Array
    inner_state: Any
    grad_sum: Any
    loss_sum: jax.Array
    num_items: jax.Array
    last_window: WindowMetrics

    def __getattr__(self, name: str) -> Any:
        """optax.MultiStepsState's field names, answered with jaxaccum's (a port's errors)."""
        if name in _OPTAX_FIELDS:
            raise AttributeError(
                f"MultiStepsState has no `{name}` (optax.MultiStepsState's); jaxaccum's:"
                f" {_OPTAX_FIELDS[name]}."
            )
        raise AttributeError(f"'MultiStepsState' object has no attribute {name!r}")


_OPTAX_FIELDS = {
    "mini_step": "`window_step`, the micro-batches of the open window (0 after a boundary;"
    " `micro_step` counts every call since init)",
    "gradient_step": "`jaxaccum.window_metrics(state).update_id`, the updates applied",
    "inner_opt_state": "`inner_state`",
    "acc_grads": "`grad_sum`, a SUM of the gradients of summed losses, not a mean",
    "skip_state": "`jaxaccum.window_metrics(state)`: `skipped`, `skip_reason`",
}


def at_least_float32(dtype: Any) -> jnp.dtype:
    """float64 for float64, else float32: the dtype a loss, its count or an unscaled gradient
    is computed in (bfloat16 and float16 upcast). Chosen without ``jnp.promote_types``,
    which strict dtype promotion refuses for bfloat16 and float64."""
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def items_dtype_for(accumulator_dtype: Any) -> jnp.dtype:
    """The dtype of ``num_items``, ``loss_sum`` and the record: float32, or float64 sums'.

    Counts must stay exact: float16 overflows at 65504 items and bfloat16 counts
    exactly only up to 256, while a window holds 10^4 to 10^6 tokens.
    """
    wide = jnp.dtype(accumulator_dtype).itemsize > 4
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def first_record(items_dtype: Any, loss_scale: float) -> WindowMetrics:
    """The record before any window closed: no loss yet (NaN), every counter 0."""
    zero = lambda dtype=items_dtype: jnp.zeros((), dtype)
    return WindowMetrics(
        micro_step=zero(jnp.int32),
        update_id=zero(jnp.int32),
        window_items=zero(),
        cumulative_items=zero(),
        loss=jnp.full((), jnp.nan, items_dtype),
        grad_norm=zero(),
        grad_norm_clipped=zero(),
        skipped=zero(jnp.bool_),
        skip_count=zero(jnp.int32),
        skip_reason=jnp.asarray(SkipReason.APPLIED, jnp.int32),
        loss_scale=jnp.asarray(loss_scale, jnp.float32),
    )


def closed_window(
    last: WindowMetrics,
    totals: Any,
    micro_step: jax.Array,
    norm_clipped: jax.Array,
    *,
    applied: jax.Array,
    finite: jax.Array,
    loss_known: jax.Array,
    loss_scale: jax.Array,
) -> WindowMetrics:
    """The record of the window that just closed (``totals``: its ``WindowTotals``)."""
    reason = jnp.where(
        applied, SkipReason.APPLIED, jnp.where(finite, SkipReason.EMPTY, SkipReason.NONFINITE)
    )
    return WindowMetrics(
        micro_step=micro_step,
        update_id=last.update_id + applied.astype(jnp.int32),
        window_items=totals.window_items,
        cumulative_items=last.cumulative_items + jnp.where(applied, totals.window_items, 0),
        loss=jnp.where(loss_known, totals.loss, jnp.nan),
        grad_norm=totals.grad_norm.astype(last.grad_norm.dtype),
        grad_norm_clipped=jnp.where(finite, norm_clipped, totals.grad_norm).astype(
            last.grad_norm.dtype
        ),  # a non-finite window: nothing clipped
        skipped=~applied,
        skip_count=last.skip_count + (~applied).astype(jnp.int32),
        skip_reason=reason.astype(jnp.int32),
        loss_scale=loss_scale,
    )
