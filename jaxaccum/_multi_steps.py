"""`multi_steps`: an Optax wrapper whose accumulated update is the big-batch update.

Like ``optax.MultiSteps`` it turns ``k`` calls of ``update`` into one update of
the inner optimizer; it carries SUMS (gradient, loss, ``num_items``) and divides
once, at the boundary, after one reduction across devices. ``update`` reads as
the algorithm: :func:`_add_to_window` on every call, :func:`_close_window` at a
boundary (reduce, normalize, clip, inner step, record, reset).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxaccum import _checks, _sharding
from jaxaccum._inner import InnerCall, once_if, standard_promotion, step_carry
from jaxaccum._loss_scale import DynamicLossScale, next_loss_scale
from jaxaccum._normalize import WindowTotals, clip_by_global_norm, normalize_window
from jaxaccum._state import MultiStepsState, closed_window, first_record, items_dtype_for


def multi_steps(
    inner: optax.GradientTransformation,
    every_k_schedule: int | Callable[[jax.Array], jax.Array],
    *,
    axis_name: str | tuple[str, ...] | None = None,
    max_grad_norm: float | None = None,
    accumulator_dtype: Any = jnp.float32,
    loss_scaling: DynamicLossScale | None = None,
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    """Accumulates ``k`` micro-batches into one big-batch update of ``inner``.

    .. math::

       g = \\frac{\\sum_{r,m} \\nabla \\ell^{sum}_{rm}}{\\sum_{r,m} n_{rm}}, \\qquad
       \\theta \\leftarrow \\theta + \\mathrm{inner}(\\mathrm{clip}(g))

    over the window's micro-batches ``m`` on devices ``r``. Each call adds this
    device's micro-batch to three sums; when the window closes (after ``k``
    calls, or at ``end_window=True``) they are reduced across devices once,
    divided once, clipped to ``max_grad_norm`` and handed to ``inner``. Between
    boundaries no collective and no inner-optimizer work runs, and the update
    is zero.

    Args:
      inner: the optimizer of the big batch, e.g. ``optax.adamw(3e-4)``. Its
        schedule counts updates, never micro-steps.
      every_k_schedule: micro-batches per window: an int, or a function of the update id
        (applied updates) returning an int, checked at 0 (below 1 later: k = 1).
      axis_name: the mesh axis the batch is split over: under ``jax.jit`` on an
        Explicit mesh (call ``init`` under ``jax.set_mesh``), ``jax.shard_map``
        or ``jax.pmap``. ``None``: one device, or ``jit`` letting the
        partitioner reduce every micro-step (GSPMD).
      max_grad_norm: clip the window gradient to this global L2 norm, once per
        window, with PyTorch's ``clip_grad_norm_`` formula; ``None``: no clip.
      accumulator_dtype: dtype of the gradient sums (float32 by default, also
        for bf16 parameters). ``num_items`` and the loss are summed in float32
        (float64 with float64 sums) whatever it is.
      loss_scaling: a :class:`DynamicLossScale` for fp16 training, or ``None``.
        Differentiate ``jaxaccum.loss_scale(state) * loss_sum``
        (``jaxaccum.value_and_grad`` does it) and pass the UNSCALED
        ``loss_sum`` to ``update``.
      nonfinite: a window whose gradient, loss or ``num_items`` is NaN or inf
        is dropped as a whole; ``"skip"`` (default) records it in
        ``window_metrics``, ``"raise"`` also fails the call with a
        ``FloatingPointError`` (a host callback).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update(grads, state,
      params=None, *, num_items, loss_sum=None, end_window=False, **extra_args)``
      takes the gradients of the local SUMMED loss, the items it adds up (valid
      tokens, samples, or a non-negative weight), the summed loss (for the record)
      and a bool, the same on every device, that closes a short window now;
      ``extra_args`` (on every call: ``inner`` is traced on each) reach
      ``inner.update`` at the boundary (the closing call's, the same on every
      device): ``value=jaxaccum.WINDOW_LOSS`` hands it the window's mean loss
      (``reduce_on_plateau``, ``polyak_sgd``); any other ``value``, ``grad``,
      ``value_fn`` or a function are refused. Its updates have ``inner``'s
      dtypes; an ``inner`` that accumulates too is refused.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxaccum
      >>> tx = jaxaccum.multi_steps(optax.sgd(1.0), every_k_schedule=2)
      >>> params = {'w': jnp.array(0.0)}
      >>> state = tx.init(params)
      >>> # micro-batch 1: 3 tokens of loss (w - 1)^2; micro-batch 2: 1 token of (w - 5)^2
      >>> for target, n in [(1.0, 3), (5.0, 1)]:
      ...     loss_fn = lambda p: (n * (p['w'] - target) ** 2, n)
      ...     (loss_sum, num_items), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
      ...     updates, state = tx.update(grads, state, params, num_items=num_items,
      ...                                loss_sum=loss_sum)
      ...     params = optax.apply_updates(params, updates)
      >>> float(params['w'])  # -lr * (3 * -2 + 1 * -10) / 4 = 4
      4.0
    """
    _checks.one_of(nonfinite, "nonfinite", ("skip", "raise"), where="multi_steps")
    _checks.instance_or_none(loss_scaling, "loss_scaling", DynamicLossScale, where="multi_steps")
    accumulator_dtype = _checks.accumulator_dtype(accumulator_dtype)
    settings = _Settings(
        inner=standard_promotion(inner),
        window_size=_checks.every_k_schedule(every_k_schedule),
        axis_name=_checks.axis_name(axis_name),
        max_grad_norm=_checks.max_grad_norm(max_grad_norm),
        accumulator_dtype=accumulator_dtype,
        items_dtype=items_dtype_for(accumulator_dtype),
        loss_scaling=loss_scaling,
        nonfinite=nonfinite,
    )

    def init_fn(params: Any) -> MultiStepsState:
        return _init(settings, params)

    def update_fn(
        grads: Any,
        state: MultiStepsState,
        params: Any = None,
        *,
        num_items: Any = None,
        loss_sum: Any = None,
        end_window: Any = False,
        **extra_args: Any,
    ) -> tuple[Any, MultiStepsState]:
        _checks.update_call(
            grads, state, num_items, loss_sum, end_window, extra_args, *settings.route
        )
        grads = jax.tree.map(jnp.asarray, grads)  # Python float leaves are accepted
        state, close = _add_to_window(settings, state, grads, num_items, loss_sum, end_window)
        inner, dynamic = InnerCall.for_call(settings.inner, extra_args, grads, state.loss_sum.dtype)
        update_types = inner.update_types(state.inner_state, params, dynamic)
        slot = _sharding.updates_slot(grads, state.grad_sum, update_types, *settings.route)
        close_window = functools.partial(_close_window, settings, inner)
        slot, state, *_ = once_if(close, close_window, slot, state, params, dynamic)
        # zeros unless this call applied an update: a select, as a skipped slot may hold NaN
        updates = jax.tree.map(lambda u: jnp.where(state.applied, u, 0).astype(u.dtype), slot)
        return updates, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """``multi_steps``' arguments, checked: what every step of the algorithm reads."""

    inner: optax.GradientTransformationExtraArgs
    window_size: Callable[[jax.Array], jax.Array]
    axis_name: _sharding.AxisName | None
    max_grad_norm: float | None
    accumulator_dtype: Any
    items_dtype: Any
    loss_scaling: DynamicLossScale | None
    nonfinite: str

    @property
    def placement(self) -> _sharding.Placement:
        """Where the window sums live in the program being traced (the mesh in context)."""
        return _sharding.placement(self.axis_name)

    @property
    def route(self) -> tuple[_sharding.AxisName | None, _sharding.Placement]:
        """``(axis_name, placement)``: the last arguments of ``_sharding``'s layout functions."""
        return self.axis_name, self.placement

    def stored(self, x: jax.Array, window_sum: jax.Array) -> jax.Array:
        """A micro-batch's value in its window sum's dtype and layout."""
        return _sharding.to_stored(x, window_sum, *self.route)

    def unstored(self, window_sum: jax.Array, ndim: int) -> jax.Array:
        """A window sum as this device's partial sum of an ``ndim``-dimensional value."""
        return _sharding.from_stored(window_sum, ndim, *self.route)


def _init(settings: _Settings, params: Any) -> MultiStepsState:
    """An empty window, no update yet."""
    scale = 1.0 if settings.loss_scaling is None else settings.loss_scaling.init_scale
    zero = lambda dtype: jnp.zeros((), dtype)
    dtypes = (settings.accumulator_dtype, settings.items_dtype)  # of the gradients, the counts
    sums = _sharding.zero_sums(params, *dtypes, *settings.route)
    first = first_record(settings.items_dtype, scale)
    return MultiStepsState(
        window_step=zero(jnp.int32),
        micro_step=zero(jnp.int32),
        good_windows=zero(jnp.int32),
        loss_known=jnp.ones((), jnp.bool_),
        applied=zero(jnp.bool_),
        inner_state=_checks.not_accumulating(settings.inner.init(params)),
        **sums,
        last_window=_sharding.replicated(first, settings.placement),
    )


def _add_to_window(settings, state, grads, num_items, loss_sum, end_window):
    """1. Every call: this micro-batch joins the window's three sums. Nothing else.

    Returns the state and whether the window closes with this call. Under
    ``jit`` a global (replicated) scalar joins the partial sums once, in the
    first row.
    """
    as_sum = lambda x, window_sum: settings.stored(jnp.reshape(jnp.asarray(x), ()), window_sum)
    window_step = state.window_step + 1
    close = window_step >= settings.window_size(state.last_window.update_id)
    close = close | jnp.asarray(end_window)
    added = state._replace(
        window_step=jnp.where(close, 0, window_step).astype(jnp.int32),
        micro_step=state.micro_step + 1,
        loss_known=state.loss_known & (loss_sum is not None),
        applied=jnp.zeros((), jnp.bool_),
        grad_sum=jax.tree.map(lambda s, g: s + settings.stored(g, s), state.grad_sum, grads),
        loss_sum=state.loss_sum + as_sum(0.0 if loss_sum is None else loss_sum, state.loss_sum),
        num_items=state.num_items + as_sum(num_items, state.num_items),
    )
    return added, close


def _close_window(settings, inner, slot, state, params, dynamic):
    """2. At a boundary, and only there: reduce once, divide once, clip, step, reset.

    The inner optimizer runs only for an applied window, on the window gradient
    in the dtype of ``grads`` (a skipped one leaves it untouched, with no select
    over its state to copy, and a slot that ``update`` replaces by zeros).
    """
    totals = _window_totals(settings, state, inner.grad_types)
    window_grads, norm_clipped = clip_by_global_norm(
        totals.grads, totals.grad_norm, settings.max_grad_norm
    )
    nonempty = totals.window_items > 0
    window_loss, window_args = inner.window_args(dynamic, totals.loss, state.loss_known)
    overflow = ~jnp.isfinite(totals.grad_norm)  # what a smaller loss scale cures (GradScaler)
    bad_loss = nonempty & ~jnp.isfinite(window_loss)  # NaN too: a WINDOW_LOSS not known
    finite = ~overflow & jnp.isfinite(totals.window_items) & ~bad_loss  # no loss_sum: adds 0
    apply = finite & nonempty
    if settings.nonfinite == "raise":
        fail = (~finite, state.micro_step, window_loss, totals.grad_norm)
        jax.debug.callback(_checks.raise_if_nonfinite, *fail, partitioned=True)  # every host
    window_grads = jax.tree.map(lambda g, t: g.astype(t.dtype), window_grads, inner.grad_types)
    carry = step_carry(slot, state.inner_state, window_grads, params, window_args)
    slot, inner_state, *_ = once_if(apply, inner.step, *carry)
    scale, good_windows = next_loss_scale(
        settings.loss_scaling,
        state.last_window.loss_scale,
        state.good_windows,
        applied=apply,
        overflow=overflow,
    )
    flags = dict(applied=apply, finite=finite, loss_known=state.loss_known, loss_scale=scale)
    record = closed_window(state.last_window, totals, state.micro_step, norm_clipped, **flags)
    state = state._replace(
        good_windows=good_windows,
        loss_known=jnp.ones((), jnp.bool_),
        applied=apply,
        inner_state=inner_state,
        last_window=record,
        **_consumed(state, totals),
    )
    return slot, state, params, dynamic


def _consumed(state: MultiStepsState, totals: WindowTotals) -> dict:
    """The three window sums once the window is read: zeros, written in place.

    A select, never ``0 * sum`` (a NaN would stay). Its predicate is true
    whatever the window held (a norm is never negative; NaN compares false),
    but it reads the window's norm, so XLA orders each reset after the last
    read of its sum and writes the zeros into the sum's own buffer. Fresh
    zeros (``zeros_like``) cost two parameter-sized copies per leaf at the
    boundary: the old sum kept for the division, the zeros put in its place.
    """
    read = ~(totals.grad_norm < 0)
    zero = lambda s: s if s.size == 0 else jnp.where(read, jnp.zeros((), s.dtype), s)
    return dict(  # an empty sum: nothing to reset (where() would drop its shard_map vma)
        grad_sum=jax.tree.map(zero, state.grad_sum),
        loss_sum=zero(state.loss_sum),
        num_items=zero(state.num_items),
    )


def _window_totals(settings, state, grad_types) -> WindowTotals:
    """The window's sums out of their stored layout, added over the devices, normalized."""
    grad_sum = jax.tree.map(lambda s, g: settings.unstored(s, g.ndim), state.grad_sum, grad_types)
    sums = (grad_sum, settings.unstored(state.loss_sum, 0), settings.unstored(state.num_items, 0))
    grad_sum, loss_sum, num_items = _sharding.reduce_over_devices(sums, settings.axis_name)
    return normalize_window(
        grad_sum,
        loss_sum,
        num_items,
        loss_scale=state.last_window.loss_scale,
        global_norm=_sharding.global_norm,
    )
