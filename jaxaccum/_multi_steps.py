"""`multi_steps`: an Optax wrapper whose accumulated update is the big-batch update.

Like ``optax.MultiSteps`` it turns ``k`` calls of ``update`` into one update of
the inner optimizer. Unlike it, it carries SUMS: the gradient of the summed
loss, the summed loss and the number of items it adds up (``num_items``), and
divides once, at the window boundary, after one reduction across devices
(``_normalize.py`` holds that math).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxaccum import _checks, _sharding
from jaxaccum._loss_scale import DynamicLossScale, next_loss_scale
from jaxaccum._normalize import clip_by_global_norm, normalize_window
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

    Each call adds this device's micro-batch to three window sums: the gradient
    of the summed loss, the summed loss and its ``num_items``. When the window
    closes (after ``k`` calls, or at ``end_window=True``) the sums are reduced
    across devices once, the window gradient ``g = sum grad(loss_sum) / sum
    num_items`` (over devices and micro-batches) is clipped to ``max_grad_norm``
    and handed to ``inner``. Between boundaries no collective and no
    inner-optimizer work runs, and the update is zero.

    Args:
      inner: the optimizer of the big batch, e.g. ``optax.adamw(3e-4)``. Its
        schedule counts updates, never micro-steps.
      every_k_schedule: micro-batches per window: an int, or a function of the
        update id (the number of applied updates) returning an int.
      axis_name: the mesh axis the batch is split over. Under ``jax.jit`` on a
        mesh whose axis is Explicit (``jax.make_mesh``'s default; call ``init``
        under ``jax.set_mesh``), the window's sums stay unreduced over it between
        calls; under ``jax.shard_map`` or ``jax.pmap`` they stay per device.
        Either way the boundary reduces them once. ``None``: one device, or
        ``jit`` letting the partitioner reduce every micro-step (GSPMD).
      max_grad_norm: clip the window gradient to this global L2 norm, once per
        window, with PyTorch's ``clip_grad_norm_`` formula; ``None``: no clip.
      accumulator_dtype: dtype of the gradient sums (float32 by default, also
        for bf16 parameters). ``num_items`` and the loss are summed in float32
        (float64 with float64 sums) whatever it is: counts stay exact.
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
      tokens, samples, or a non-negative weight), the summed loss (for the
      record) and a bool that closes a short window now; ``extra_args`` reach
      ``inner.update``. Its updates have the inner optimizer's update dtypes.

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
    window_size = _checks.every_k_schedule(every_k_schedule)
    axis_name = _checks.axis_name(axis_name)
    max_grad_norm = _checks.max_grad_norm(max_grad_norm)
    accumulator_dtype = _checks.accumulator_dtype(accumulator_dtype)
    _checks.one_of(nonfinite, "nonfinite", ("skip", "raise"), where="multi_steps")
    _checks.instance_or_none(loss_scaling, "loss_scaling", DynamicLossScale, where="multi_steps")
    inner = optax.with_extra_args_support(inner)
    # counts and the loss stay exact whatever the gradient sums' dtype: float32 or wider
    items_dtype = items_dtype_for(accumulator_dtype)
    zero = lambda dtype=accumulator_dtype: jnp.zeros((), dtype)

    def init_fn(params: Any) -> MultiStepsState:
        scale = 1.0 if loss_scaling is None else loss_scaling.init_scale
        where = _sharding.layout(axis_name)
        return MultiStepsState(
            window_step=zero(jnp.int32),
            micro_step=zero(jnp.int32),
            good_windows=zero(jnp.int32),
            loss_known=jnp.ones((), jnp.bool_),
            applied=zero(jnp.bool_),
            inner_state=_standard_promotion(inner.init)(params),
            **_sharding.zero_sums(params, accumulator_dtype, items_dtype, axis_name, where),
            last_window=_sharding.replicated(first_record(items_dtype, scale), where),
        )

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
        where = _sharding.layout(axis_name)
        _checks.update_call(grads, state, num_items, loss_sum, end_window, extra_args, where,
                            axis_name)  # fmt: skip
        grads = jax.tree.map(jnp.asarray, grads)  # Python float leaves are accepted
        stored = lambda x, window_sum: _sharding.to_stored(x, window_sum, axis_name, where)
        unstored = lambda window_sum, ndim: _sharding.from_stored(window_sum, ndim, axis_name,
                                                                  where)  # fmt: skip
        grad_dtypes = jax.tree.map(lambda g: g.dtype, grads)
        # Arrays among the extra arguments travel in the loop carry; the rest are constants.
        dynamic = {k: v for k, v in extra_args.items() if isinstance(v, jax.Array)}
        static = {k: v for k, v in extra_args.items() if k not in dynamic}

        def inner_update(window_grads, inner_state, params, dynamic):
            # the inner optimizer is the user's code: it runs under JAX's standard
            # promotion (optax's bias corrections mix a float and an int32 step)
            with jax.numpy_dtype_promotion("standard"):
                return inner.update(window_grads, inner_state, params, **static, **dynamic)

        # 1. Every call: add this micro-batch to the window sums. Nothing else.
        # under jit, a global (replicated) value joins the partial sums once (in the first row)
        as_sum = lambda x, window_sum: stored(jnp.reshape(jnp.asarray(x), ()), window_sum)
        window_step = state.window_step + 1
        close = (window_step >= window_size(state.last_window.update_id)) | jnp.asarray(end_window)
        added = state._replace(
            window_step=jnp.where(close, 0, window_step).astype(jnp.int32),
            micro_step=state.micro_step + 1,
            loss_known=state.loss_known & (loss_sum is not None),
            applied=zero(jnp.bool_),
            grad_sum=jax.tree.map(lambda s, g: s + stored(g, s), state.grad_sum, grads),
            loss_sum=state.loss_sum + as_sum(0.0 if loss_sum is None else loss_sum, state.loss_sum),
            num_items=state.num_items + as_sum(num_items, state.num_items),
        )

        # 2. At a boundary, and only there: reduce once, divide once, clip, step.
        def inner_step(slot, inner_state, window_grads, params, dynamic):
            updates, new_inner = inner_update(window_grads, inner_state, params, dynamic)
            # the types of the loop carry: dtypes, and shardings (an inner state sharded
            # over the batch axis, ZeRO-1, gives sharded updates: gathered here)
            like = lambda x, y: _sharding.like(x.astype(y.dtype), y)
            updates = jax.tree.map(like, updates, slot)
            new_inner = jax.tree.map(like, new_inner, inner_state)
            return updates, new_inner, window_grads, params, dynamic

        def boundary(slot, state, params, dynamic):
            totals = normalize_window(
                jax.tree.map(lambda s, g: unstored(s, g.ndim), state.grad_sum, grad_types),
                unstored(state.loss_sum, 0),
                unstored(state.num_items, 0),
                axis_name=axis_name,
                loss_scale=state.last_window.loss_scale,
            )
            window_grads, norm_clipped = clip_by_global_norm(
                totals.grads, totals.grad_norm, max_grad_norm
            )
            nonempty = totals.window_items > 0
            bad_loss = state.loss_known & nonempty & ~jnp.isfinite(totals.loss)
            finite = jnp.isfinite(totals.grad_norm) & jnp.isfinite(totals.window_items) & ~bad_loss
            apply = finite & nonempty
            if nonfinite == "raise":
                fail = (~finite, state.micro_step, totals.loss, totals.grad_norm)
                jax.debug.callback(_checks.raise_if_nonfinite, *fail)
            # The inner optimizer runs only for an applied window, on the window
            # gradient in the dtype of `grads` (a skipped one leaves it untouched,
            # with no select over its state to copy).
            window_grads = jax.tree.map(lambda g, d: g.astype(d), window_grads, grad_dtypes)
            slot, inner_state, *_ = _once_if(
                apply, inner_step, slot, state.inner_state, window_grads, params, dynamic
            )
            scale, good_windows = next_loss_scale(
                loss_scaling,
                state.last_window.loss_scale,
                state.good_windows,
                applied=apply,
                overflow=~finite,
            )
            state = state._replace(
                good_windows=good_windows,
                loss_known=jnp.ones((), jnp.bool_),
                applied=apply,
                inner_state=inner_state,
                last_window=closed_window(
                    state.last_window,
                    totals,
                    state.micro_step,
                    norm_clipped,
                    applied=apply,
                    finite=finite,
                    loss_known=state.loss_known,
                    loss_scale=scale,
                ),  # fmt: skip
                # the window is consumed: fresh zeros of the sums' types (never 0 * sum)
                grad_sum=jax.tree.map(jnp.zeros_like, state.grad_sum),
                loss_sum=jnp.zeros_like(state.loss_sum),
                num_items=jnp.zeros_like(state.num_items),
            )
            return slot, state, params, dynamic

        # The updates' slot: the inner optimizer's update dtypes (eval_shape traces it,
        # nothing runs), the parameters' shardings.
        grad_types = jax.tree.map(lambda g: jax.ShapeDtypeStruct(jnp.shape(g), g.dtype), grads)
        update_types = jax.eval_shape(inner_update, grad_types, state.inner_state, params, dynamic)
        slot = _sharding.updates_slot(grads, state.grad_sum, update_types[0], axis_name, where)
        slot, new_state, *_ = _once_if(close, boundary, slot, added, params, dynamic)
        # Zero unless this call applied an update (a select: no NaN can leak).
        updates = jax.tree.map(lambda u: jnp.where(new_state.applied, u, 0).astype(u.dtype), slot)
        return updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _standard_promotion(fn: Callable) -> Callable:
    def wrapped(*args, **kwargs):
        with jax.numpy_dtype_promotion("standard"):
            return fn(*args, **kwargs)

    return wrapped


def _once_if(pred: jax.Array, body: Callable[..., tuple], *carry: Any) -> tuple:
    """``body(*carry)`` if ``pred`` else ``carry``: a while loop of zero or one trip.

    XLA keeps a while loop's carry in place: when it does not run, the carried
    buffers (the inner state, the sums) are neither copied nor touched, where a
    ``cond`` copies them into its result. The body reads nothing but its carry,
    so nothing can be hoisted out of it and run on every call.
    """
    _, carry = jax.lax.while_loop(
        lambda loop: loop[0], lambda loop: (jnp.zeros((), jnp.bool_), body(*loop[1])), (pred, carry)
    )
    return carry
