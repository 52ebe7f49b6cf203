"""`multi_steps`: an Optax wrapper whose accumulated update is the big-batch update.

Like ``optax.MultiSteps`` it turns ``k`` calls of ``update`` into one update of
the inner optimizer. Unlike it, it carries SUMS: the gradient of the summed
loss, the summed loss and the count of loss units, and divides once at the
window boundary (see ``_normalize.py``), after one ``psum`` across devices.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum._normalize import clip_by_global_norm, normalize_window

AxisName = str | tuple[str, ...]

# Why a window was skipped (``WindowRecord.skip_reason``).
APPLIED = 0
SKIP_EMPTY = 1  # the global count of loss units was 0 (or negative)
SKIP_NONFINITE = 2  # the normalized gradient or the loss was NaN or inf
SKIP_REASONS = {APPLIED: "applied", SKIP_EMPTY: "empty", SKIP_NONFINITE: "nonfinite"}


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """fp16 dynamic loss scaling per window, PyTorch ``GradScaler``'s schedule.

    The scale is constant inside a window. At the boundary the gradient is
    unscaled once; a non-finite window is skipped and the scale multiplied by
    ``backoff_factor``; after ``growth_interval`` consecutive applied windows it
    is multiplied by ``growth_factor``. Empty windows change nothing.

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

    def __post_init__(self):
        def real(value):
            return isinstance(value, numbers.Real) and not isinstance(value, bool)

        def float32_finite(value):
            return real(value) and np.isfinite(np.float32(value))

        checks = [
            (
                "init_scale",
                float32_finite(self.init_scale) and self.init_scale > 0,
                "a finite float32 number > 0",
            ),
            (
                "growth_factor",
                float32_finite(self.growth_factor) and self.growth_factor > 1,
                "a finite number > 1",
            ),
            (
                "backoff_factor",
                real(self.backoff_factor) and 0 < self.backoff_factor < 1,
                "a number in (0, 1)",
            ),
            (
                "growth_interval",
                isinstance(self.growth_interval, numbers.Integral)
                and not isinstance(self.growth_interval, bool)
                and self.growth_interval >= 1,
                "an int >= 1",
            ),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(
                    f"DynamicLossScale: `{name}` must be {expected}; got {getattr(self, name)!r}."
                )


class WindowRecord(NamedTuple):
    """What happened in the last closed window (all scalars, replicated).

    Attributes:
      micro_step: int32, micro-batches seen on this device since ``init``, at the
        end of the window.
      window_count: float32, global loss units ``N`` of the window (all
        micro-batches of all devices); 0 if a traced count was NaN or inf.
      loss: float32, the window mean loss ``sum loss_sum / N`` (0 if the window
        was empty or not finite, or if ``loss_sum`` was never passed).
      grad_norm: float32, L2 norm of the normalized window gradient before
        clipping (0 if not finite).
      grad_norm_clipped: float32, the norm after clipping (== ``grad_norm``
        without clipping).
      skipped: bool, the window was dropped: no parameter change.
      skip_reason: int32, ``0`` applied, ``1`` empty window, ``2`` non-finite.
    """

    micro_step: jax.Array
    window_count: jax.Array
    loss: jax.Array
    grad_norm: jax.Array
    grad_norm_clipped: jax.Array
    skipped: jax.Array
    skip_reason: jax.Array


class MultiStepsState(NamedTuple):
    """State of :func:`multi_steps`.

    Per-device leaves (they differ between devices between boundaries): with an
    ``axis_name`` they carry a leading axis of length 1, so that under
    ``shard_map`` the global state stacks one slice per device (see
    :func:`partition_specs`). All other leaves are identical on every device.

    Attributes:
      window_step: int32, micro-batches accumulated in the open window.
      micro_step: int32, micro-batches seen since ``init``.
      update_id: int32, updates applied since ``init``; skipped windows do not
        count. The inner optimizer (and its schedule) counts the same updates.
      cumulative_count: global loss units of all applied windows. This and
        every other float scalar of the state (the sums, the record) has the
        ``accumulator_dtype``, float32 by default; ``loss_scale`` is float32.
      skip_count: int32, windows skipped since ``init``.
      applied: bool, whether the call that returned this state applied an update.
      loss_scale: float32, the factor the summed loss is multiplied by before
        differentiation (fp16 loss scaling; 1 without it). Constant in a window.
      good_windows: int32, applied windows since the loss scale last changed
        (PyTorch's growth tracker).
      inner_state: the inner optimizer's state.
      grad_sum: per device, the sum over the open window of the gradients of the
        summed loss (``accumulator_dtype``, float32 by default).
      loss_sum: per device, the summed loss of the open window.
      count: per device, the loss units of the open window.
      last_window: the :class:`WindowRecord` of the last closed window.
    """

    window_step: jax.Array
    micro_step: jax.Array
    update_id: jax.Array
    cumulative_count: jax.Array
    skip_count: jax.Array
    applied: jax.Array
    loss_scale: jax.Array
    good_windows: jax.Array
    inner_state: Any
    grad_sum: Any
    loss_sum: jax.Array
    count: jax.Array
    last_window: WindowRecord


PER_DEVICE_FIELDS = ("grad_sum", "loss_sum", "count")

# How the boundary is skipped between boundaries: "while" (default) or "cond".
# Kept switchable for the benchmark that compares them.
_BOUNDARY_IMPL = "while"


def _validate_every_k(every_k_schedule: Any) -> Callable[[jax.Array], jax.Array]:
    if isinstance(every_k_schedule, bool) or not (
        isinstance(every_k_schedule, numbers.Integral) or callable(every_k_schedule)
    ):
        raise TypeError(
            "multi_steps: `every_k_schedule` must be a positive int or a callable"
            f" update_id -> int; got {every_k_schedule!r}"
            f" ({type(every_k_schedule).__name__})."
        )
    if not callable(every_k_schedule):
        if every_k_schedule < 1:
            raise ValueError(
                "multi_steps: `every_k_schedule` must be >= 1 (micro-batches per"
                f" update); got {every_k_schedule}."
            )
        k = int(every_k_schedule)
        return lambda update_id: jnp.asarray(k, jnp.int32)
    first = every_k_schedule(jnp.asarray(0, jnp.int32))
    try:
        first_value = np.asarray(first)
    except jax.errors.TracerArrayConversionError:
        first_value = None
    if first_value is not None and (
        first_value.shape != ()
        or not np.issubdtype(first_value.dtype, np.integer)
        or first_value < 1
    ):
        raise ValueError(
            "multi_steps: `every_k_schedule(0)` must return a scalar >= 1; got"
            f" {first!r} (an integer number of micro-batches)."
        )

    def window_size(update_id: jax.Array) -> jax.Array:
        k = every_k_schedule(update_id)
        if not jnp.issubdtype(jnp.result_type(k), jnp.integer):
            raise TypeError(
                "multi_steps: `every_k_schedule` must return an integer number of"
                f" micro-batches; got dtype {jnp.result_type(k)}."
            )
        return jnp.asarray(k, jnp.int32)

    return window_size


def _check_count(count: Any) -> None:
    if count is None:
        raise TypeError(
            "multi_steps.update: `count` is required: the number of loss units"
            " (valid tokens, or samples) behind `grads`, which must be gradients of"
            " the SUMMED loss. Pass count=0 for a micro-batch with no unit."
        )
    dtype = None if isinstance(count, bool) else getattr(count, "dtype", None)
    if dtype is None and not isinstance(count, numbers.Real) or isinstance(count, bool):
        raise TypeError(
            "multi_steps.update: `count` must be an int or float scalar; got"
            f" {type(count).__name__} {count!r}."
        )
    if dtype is not None and not (
        np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating)
    ):
        raise TypeError(
            f"multi_steps.update: `count` must be an int or float scalar; got dtype {dtype}."
        )
    shape = np.shape(count)
    if int(np.prod(shape)) != 1:
        raise ValueError(
            "multi_steps.update: `count` must be a scalar (one count per call and"
            f" device); got shape {shape}."
        )
    if isinstance(count, jax.core.Tracer):
        return  # checked at the boundary: a non-finite window count is skipped
    value = float(np.asarray(count).reshape(()))
    if value < 0 or not np.isfinite(value):
        raise ValueError(
            "multi_steps.update: `count` must be a finite number >= 0 (a weight"
            f" of loss units); got {value}."
        )


def _check_scalar_arg(name: str, value: Any, kinds: tuple[Any, ...]) -> None:
    """`loss_sum` (a number) and `end_window` (a bool): scalars of the right kind."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        ok = isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))
    else:
        ok = any(np.issubdtype(dtype, kind) for kind in kinds if kind is not bool) or (
            bool in kinds and dtype == np.bool_
        )
    if not ok:
        raise TypeError(
            f"multi_steps.update: `{name}` must be a"
            f" {'bool' if bool in kinds else 'real number'} scalar; got"
            f" {type(value).__name__} {value!r}."
        )
    if int(np.prod(np.shape(value))) != 1:
        raise ValueError(
            f"multi_steps.update: `{name}` must be a scalar; got shape {np.shape(value)}."
        )


def _check_grads(grads: Any, grad_sum: Any, per_device: bool) -> None:
    grads_def = jax.tree.structure(grads)
    sums_def = jax.tree.structure(grad_sum)
    if grads_def != sums_def:
        raise ValueError(
            "multi_steps.update: `grads` does not have the structure of the"
            f" parameters passed to init.\n  grads: {grads_def}\n  state: {sums_def}"
        )
    for path, g, s in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0],
        jax.tree.leaves(grads),
        jax.tree.leaves(grad_sum),
    ):
        where = jax.tree_util.keystr(path[0])
        if per_device and (s.ndim == 0 or s.shape[0] != 1):
            raise ValueError(
                f"multi_steps.update: the state's window sum {where} has shape"
                f" {tuple(s.shape)}, without the leading device axis of length 1 that"
                " multi_steps(..., axis_name=...) gives it: was this state made by a"
                " multi_steps without the same axis_name?"
            )
        expected = s.shape[1:] if per_device else s.shape
        if tuple(np.shape(g)) != tuple(expected):
            hint = (
                " (a state made with an axis_name carries a leading device axis of"
                " length 1; is the axis_name the same?)"
                if not per_device and s.ndim and s.shape[0] == 1
                else ""
            )
            raise ValueError(
                f"multi_steps.update: `grads` leaf {where} has shape"
                f" {tuple(np.shape(g))}; the state expects {tuple(expected)}{hint}."
            )
        dtype = jnp.result_type(g)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"multi_steps.update: `grads` leaf {where} has dtype {dtype};"
                " expected a real floating dtype."
            )


def _varying_axes(x: Any) -> frozenset:
    """The ``shard_map`` axes over which ``x`` differs (empty outside, or in pmap)."""
    aval = jax.typeof(jnp.asarray(x))
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def _check_not_reduced(grads: Any, count: Any, axis_name: AxisName) -> None:
    """Rejects gradients that JAX already summed over the devices.

    Inside ``shard_map`` (with ``check_vma``) the gradient with respect to
    replicated parameters of a per-device loss is summed over the axis by JAX's
    autodiff: a collective on every micro-step, and a second sum at our
    boundary would count every device ``R`` times.
    """
    axes = frozenset(axis_name if isinstance(axis_name, tuple) else (axis_name,))
    if not axes <= _varying_axes(count):
        return  # the count is replicated too (or we are under pmap): nothing to compare
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        if not axes <= _varying_axes(g):
            raise ValueError(
                f"multi_steps.update: `grads` leaf {jax.tree_util.keystr(path)} is"
                f" already summed over {sorted(axes)} (replicated), while `count` is"
                " per device. Inside shard_map, differentiate with respect to"
                f" jax.lax.pcast(params, {axis_name!r}, to='varying') so that each"
                " device keeps its own gradient; the window's single psum happens at"
                " the boundary."
            )


def _check_axis_bound(axis_name: AxisName) -> None:
    for name in axis_name if isinstance(axis_name, tuple) else (axis_name,):
        try:
            jax.lax.axis_size(name)
        except NameError:
            raise NameError(
                f"multi_steps: axis_name {name!r} is not bound here: call update"
                " inside jax.pmap(..., axis_name=...) or jax.shard_map over a mesh"
                f" with that axis, or build multi_steps without axis_name."
            ) from None


def _scalar(value: Any, dtype: Any) -> jax.Array:
    return jnp.reshape(jnp.asarray(value, dtype), ())


def multi_steps(
    inner: optax.GradientTransformation,
    every_k_schedule: int | Callable[[jax.Array], jax.Array],
    *,
    axis_name: AxisName | None = None,
    max_grad_norm: float | None = None,
    accumulator_dtype: Any = jnp.float32,
    loss_scaling: DynamicLossScale | None = None,
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    """Accumulates ``k`` micro-batches into one big-batch update of ``inner``.

    Each call adds this device's micro-batch to three window sums: the gradient
    of the summed loss, the summed loss and the count of loss units. When the
    window closes (``k`` calls, or ``end_window=True``) the sums are added
    across devices in one ``psum`` (when ``axis_name`` is given), divided once by
    the global count, optionally clipped to ``max_grad_norm`` by global norm,
    and handed to ``inner``::

        g = psum(sum_m grad(loss_sum_m)) / psum(sum_m count_m)

    which is exactly the gradient of the big batch's token-weighted mean loss.
    Between boundaries nothing but the three additions runs: no collective and
    no inner-optimizer work; the returned updates are zeros.

    A window is skipped (zero updates; ``inner_state``, ``update_id`` and the
    schedule unchanged; accumulators reset) when its global count is 0, or its
    normalized gradient or loss is not finite. The state never keeps a NaN.

    ``count`` is a weight: valid tokens for token-level losses, samples for
    sample-level ones, or any non-negative real number (a fractional count
    weighs a unit fractionally). Python numbers below 0 are rejected; a traced
    negative count is not checked per call, and a window whose global count is
    not positive is skipped as empty. Counts are float32: integer counts are
    exact up to 2**24 loss units per window.

    Args:
      inner: the optimizer to apply once per window (e.g. ``optax.adamw``).
        Its schedule counts updates, never micro-steps.
      every_k_schedule: micro-batches per window, an int >= 1 or a callable
        ``update_id -> int`` (evaluated with the updates applied so far).
      axis_name: the ``pmap``/``shard_map`` axis to add the window sums over at
        the boundary. ``None`` for one device, or for ``jit`` over globally
        sharded arrays (the sums are already global). With an axis name the
        per-device leaves carry a leading axis of 1 (see :func:`partition_specs`).
      max_grad_norm: if set, clip the window gradient to this global L2 norm
        (PyTorch's ``clip_grad_norm_`` formula), once per window.
      accumulator_dtype: dtype of the gradient sums (float32 by default, also
        for bf16 parameters).
      loss_scaling: a :class:`DynamicLossScale` for fp16 training, or ``None``.
        Multiply the summed loss by ``jaxaccum.loss_scale(state)`` before
        differentiating (``jaxaccum.value_and_grad`` does it); pass the
        UNSCALED ``loss_sum`` to ``update``.
      nonfinite: what a window with a NaN/inf gradient or loss does: ``"skip"``
        (default: dropped as a whole, counted in ``skip_count``) or ``"raise"``
        (also dropped, and the call fails with a ``FloatingPointError`` naming
        the window: a host callback, so it surfaces as a runtime error of the
        jitted call; with donated buffers the previous state is gone too).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` is
      ``update(grads, state, params=None, *, count, loss_sum=None,
      end_window=False, **extra_args)``: ``grads`` are gradients of the local
      SUMMED loss, ``count`` its local count of loss units, ``loss_sum`` the
      summed loss value (for the window record), ``end_window`` (Python or traced
      bool) closes a partial window now, e.g. at the end of an epoch. Extra
      keyword arguments reach ``inner.update`` at the boundary.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxaccum
      >>> tx = jaxaccum.multi_steps(optax.sgd(1.0), every_k_schedule=2)
      >>> params = {'w': jnp.array(0.0)}
      >>> state = tx.init(params)
      >>> # micro-batch 1: 3 tokens with loss (w - 1)^2 each; micro-batch 2: 1 token, (w - 5)^2
      >>> for target, n in [(1.0, 3), (5.0, 1)]:
      ...   loss_fn = lambda p: (n * (p['w'] - target) ** 2, n)
      ...   (loss_sum, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
      ...   updates, state = tx.update(grads, state, params, count=count, loss_sum=loss_sum)
      ...   params = optax.apply_updates(params, updates)
      >>> float(params['w'])  # -lr * (3 * -2 + 1 * -10) / 4 = 4
      4.0
    """
    window_size = _validate_every_k(every_k_schedule)
    per_device = axis_name is not None
    if nonfinite not in ("skip", "raise"):
        raise ValueError(f"multi_steps: `nonfinite` must be 'skip' or 'raise'; got {nonfinite!r}.")
    if loss_scaling is not None and not isinstance(loss_scaling, DynamicLossScale):
        raise TypeError(
            "multi_steps: `loss_scaling` must be a jaxaccum.DynamicLossScale or"
            f" None; got {type(loss_scaling).__name__}."
        )
    init_scale = 1.0 if loss_scaling is None else loss_scaling.init_scale
    if max_grad_norm is not None:
        if not isinstance(max_grad_norm, numbers.Real) or isinstance(max_grad_norm, bool):
            raise TypeError(
                "multi_steps: `max_grad_norm` must be None or a number > 0; got"
                f" {type(max_grad_norm).__name__} {max_grad_norm!r}."
            )
        if not (np.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(
                "multi_steps: `max_grad_norm` must be None or a finite number > 0;"
                f" got {max_grad_norm}."
            )
    if not jnp.issubdtype(jnp.dtype(accumulator_dtype), jnp.floating):
        raise TypeError(
            "multi_steps: `accumulator_dtype` must be a real floating dtype (float32"
            f" by default); got {jnp.dtype(accumulator_dtype)}."
        )

    def local(x: jax.Array) -> jax.Array:
        """A per-device leaf in its stored layout (leading axis 1 with an axis name)."""
        return x[None] if per_device else x

    def init_fn(params: Any) -> MultiStepsState:
        int_zero = lambda: jnp.zeros((), jnp.int32)
        float_zero = lambda: jnp.zeros((), accumulator_dtype)
        return MultiStepsState(
            window_step=int_zero(),
            micro_step=int_zero(),
            update_id=int_zero(),
            cumulative_count=float_zero(),
            skip_count=int_zero(),
            applied=jnp.zeros((), jnp.bool_),
            loss_scale=jnp.asarray(init_scale, jnp.float32),  # always float32
            good_windows=int_zero(),
            inner_state=inner.init(params),
            grad_sum=jax.tree.map(
                lambda p: local(jnp.zeros(jnp.shape(p), accumulator_dtype)), params
            ),
            loss_sum=local(float_zero()),
            count=local(float_zero()),
            last_window=WindowRecord(
                micro_step=int_zero(),
                window_count=float_zero(),
                loss=float_zero(),
                grad_norm=float_zero(),
                grad_norm_clipped=float_zero(),
                skipped=jnp.zeros((), jnp.bool_),
                skip_reason=int_zero(),
            ),
        )

    def update_fn(
        updates: Any,
        state: MultiStepsState,
        params: Any = None,
        *,
        count: Any = None,
        loss_sum: Any = None,
        end_window: Any = False,
        **extra_args: Any,
    ) -> tuple[Any, MultiStepsState]:
        if not isinstance(state, MultiStepsState):
            raise TypeError(
                "multi_steps.update: `state` must be the MultiStepsState returned by"
                f" init; got {type(state).__name__}."
            )
        _check_count(count)
        if loss_sum is not None:
            _check_scalar_arg("loss_sum", loss_sum, (numbers.Real, np.integer, np.floating))
        _check_scalar_arg("end_window", end_window, (bool, np.bool_))
        _check_grads(updates, state.grad_sum, per_device)
        if per_device:
            _check_axis_bound(axis_name)
            _check_not_reduced(updates, count, axis_name)
        grads = updates

        grad_sum = jax.tree.map(
            lambda s, g: s + local(jnp.asarray(g).astype(s.dtype)),
            state.grad_sum,
            grads,
        )
        loss_sum = state.loss_sum + local(
            _scalar(0.0 if loss_sum is None else loss_sum, accumulator_dtype)
        )
        count_sum = state.count + local(_scalar(count, accumulator_dtype))
        window_step = state.window_step + 1
        micro_step = state.micro_step + 1
        close = (window_step >= window_size(state.update_id)) | jnp.asarray(end_window, jnp.bool_)

        def updates_slot() -> Any:
            """The loop's slot for the updates, in the parameters' dtypes.

            On one device it starts as this micro-step's gradient, a buffer that
            is dead once added to the window sum, so XLA reuses it instead of
            allocating and copying zeros; it is replaced by zeros (a select) unless
            an update was applied. With an axis name the gradient differs per
            device while the updates are replicated, so the slot starts as zeros.
            """
            reference = grads if params is None else params
            if per_device:
                return jax.tree.map(
                    lambda r: jnp.zeros(jnp.shape(r), jnp.result_type(r)), reference
                )
            return jax.tree.map(
                lambda g, r: jnp.asarray(g).astype(jnp.result_type(r)), grads, reference
            )

        def boundary(
            slot_and_state: tuple[Any, MultiStepsState],
        ) -> tuple[Any, MultiStepsState]:
            """Closes the window: the loop body (explicit carry, no closures)."""
            slot, current = slot_and_state
            unstack = (lambda x: x[0]) if per_device else (lambda x: x)
            totals = normalize_window(
                jax.tree.map(unstack, current.grad_sum),
                unstack(current.loss_sum),
                unstack(current.count),
                axis_name=axis_name,
                loss_scale=current.loss_scale,
            )
            window_grads, norm_clipped = clip_by_global_norm(
                totals.grads, totals.grad_norm, max_grad_norm
            )
            # A NaN/inf count (a traced weight) makes the window non-finite too.
            finite = (
                jnp.isfinite(totals.grad_norm)
                & jnp.isfinite(totals.loss)
                & jnp.isfinite(totals.window_count)
            )
            nonempty = totals.window_count > 0
            apply = finite & nonempty
            inner_updates, new_inner = inner.update(
                window_grads, current.inner_state, params, **extra_args
            )
            # Keep the inner state's dtypes (e.g. bf16 moments fed float32 grads).
            new_inner = jax.tree.map(
                lambda new, old: jnp.where(apply, new.astype(old.dtype), old),
                new_inner,
                current.inner_state,
            )
            new_updates = jax.tree.map(lambda u, r: u.astype(r.dtype), inner_updates, slot)
            skip_reason = jnp.where(
                apply, APPLIED, jnp.where(finite, SKIP_EMPTY, SKIP_NONFINITE)
            ).astype(jnp.int32)
            overflow = ~finite
            if nonfinite == "raise":
                jax.debug.callback(
                    _raise_nonfinite, overflow, current.micro_step, totals.loss, totals.grad_norm
                )
            loss_scale, good_windows = current.loss_scale, current.good_windows
            if loss_scaling is not None:
                grow = apply & (good_windows + 1 >= loss_scaling.growth_interval)
                loss_scale = jnp.where(
                    overflow,
                    loss_scale * loss_scaling.backoff_factor,
                    jnp.where(grow, loss_scale * loss_scaling.growth_factor, loss_scale),
                ).astype(jnp.float32)
                good_windows = jnp.where(
                    overflow | grow, 0, good_windows + apply.astype(jnp.int32)
                ).astype(jnp.int32)
            record = WindowRecord(
                micro_step=current.micro_step,
                window_count=jnp.where(jnp.isfinite(totals.window_count), totals.window_count, 0.0),
                loss=jnp.where(finite, totals.loss, 0.0),
                grad_norm=jnp.where(finite, totals.grad_norm, 0.0),
                grad_norm_clipped=jnp.where(finite, norm_clipped, 0.0),
                skipped=~apply,
                skip_reason=skip_reason,
            )
            # The window is consumed: reset its sums with fresh zeros (a select,
            # never a multiplication by a mask: 0 * NaN = NaN).
            return new_updates, current._replace(
                grad_sum=jax.tree.map(jnp.zeros_like, current.grad_sum),
                loss_sum=jnp.zeros_like(current.loss_sum),
                count=jnp.zeros_like(current.count),
                inner_state=new_inner,
                update_id=current.update_id + apply.astype(jnp.int32),
                cumulative_count=current.cumulative_count
                + jnp.where(apply, totals.window_count, 0.0),
                skip_count=current.skip_count + (~apply).astype(jnp.int32),
                applied=apply,
                loss_scale=loss_scale,
                good_windows=good_windows,
                last_window=record,
            )

        # The state as it stands between boundaries: the new sums and counters.
        between = state._replace(
            window_step=jnp.where(close, 0, window_step).astype(jnp.int32),
            micro_step=micro_step,
            applied=jnp.zeros((), jnp.bool_),
            grad_sum=grad_sum,
            loss_sum=loss_sum,
            count=count_sum,
        )
        carry = (updates_slot(), between)
        if _BOUNDARY_IMPL == "cond":
            slot, new_state = jax.lax.cond(close, boundary, lambda c: c, carry)
        else:
            # A loop that runs once at a boundary and zero times in between. XLA
            # updates a while loop's carry in place, so between boundaries the
            # inner state is neither copied nor touched (a cond copies it into its
            # result on every call). Every value the boundary reads is in the carry,
            # so nothing can be hoisted out of the loop and run every micro-step.
            _, (slot, new_state) = jax.lax.while_loop(
                lambda loop: loop[0],
                lambda loop: (jnp.zeros((), jnp.bool_), boundary(loop[1])),
                (close, carry),
            )
        # Zero unless this call applied an update (a select: a NaN cannot leak).
        new_updates = jax.tree.map(
            lambda u: jnp.where(new_state.applied, u, jnp.zeros_like(u)), slot
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _raise_nonfinite(overflow, micro_step, loss, grad_norm) -> None:
    if bool(overflow):
        raise FloatingPointError(
            "jaxaccum.multi_steps(nonfinite='raise'): the window ending at"
            f" micro-step {int(micro_step)} has a non-finite gradient or loss"
            f" (loss={float(loss)}, grad_norm={float(grad_norm)}); it was not applied."
        )


def _find_state(opt_state: Any, caller: str) -> MultiStepsState:
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MultiStepsState))
        if isinstance(s, MultiStepsState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"{caller}: expected exactly one jaxaccum MultiStepsState inside the"
            f" optimizer state; found {len(found)}."
        )
    return found[0]


def has_updated(opt_state: Any) -> jax.Array:
    """Whether the ``update`` call that returned ``opt_state`` applied an update.

    False between boundaries and after a skipped window. Accepts the state of
    :func:`multi_steps` or any optimizer state containing exactly one of it
    (e.g. inside ``optax.chain``).
    """
    return _find_state(opt_state, "has_updated").applied


def loss_scale(opt_state: Any) -> jax.Array:
    """The factor to multiply the summed loss by before differentiating.

    1.0 unless ``multi_steps(..., loss_scaling=DynamicLossScale(...))``. It is
    constant inside a window and changes only at a boundary.
    """
    return _find_state(opt_state, "loss_scale").loss_scale


def window_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """The record of the last closed window, as a dict of scalars.

    Keys (the same as ``torch_ref``'s records): ``micro_step``, ``update_id``,
    ``window_count`` (global loss units), ``cumulative_count``, ``loss`` (window
    mean), ``grad_norm`` (before clipping), ``grad_norm_clipped``, ``skipped``;
    plus ``skip_count``, ``skip_reason`` (0 applied, 1 empty, 2 non-finite)
    and ``loss_scale`` (the scale for the next window).
    Between boundaries it still describes the last closed window.
    """
    state = _find_state(opt_state, "window_metrics")
    record = state.last_window
    return {
        "micro_step": record.micro_step,
        "update_id": state.update_id,
        "window_count": record.window_count,
        "cumulative_count": state.cumulative_count,
        "loss": record.loss,
        "grad_norm": record.grad_norm,
        "grad_norm_clipped": record.grad_norm_clipped,
        "skipped": record.skipped,
        "skip_count": state.skip_count,
        "skip_reason": record.skip_reason,
        "loss_scale": state.loss_scale,
    }


def partition_specs(opt_state: Any, axis_name: AxisName) -> Any:
    """``PartitionSpec``s of an optimizer state for ``jax.shard_map``.

    Between boundaries the window sums differ from device to device, so they
    must not be declared replicated. With ``multi_steps(..., axis_name=...)``
    each per-device leaf (``grad_sum``, ``loss_sum``, ``count``) holds a leading
    axis of length 1; this function gives those leaves ``P(axis_name)`` (the
    global array stacks one slice per device) and every other leaf ``P()``
    (replicated: the inner state, the counters, the window record).

    Args:
      opt_state: an optimizer state (or its ``jax.eval_shape``) containing one
        or more :class:`MultiStepsState`.
      axis_name: the mesh axis the devices are mapped over.

    Returns:
      A pytree of ``PartitionSpec`` with the structure of ``opt_state``.

    Example:
      >>> import jax, optax, jaxaccum
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ('data',))
      >>> tx = jaxaccum.multi_steps(optax.sgd(0.1), 2, axis_name='data')
      >>> params = {'w': jax.numpy.zeros(3)}
      >>> specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, params), 'data')
      >>> state = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)
      >>> state.grad_sum['w'].shape  # one row per device
      (1, 3)
    """
    from jax.sharding import PartitionSpec as P

    def specs_of(node: Any) -> Any:
        if not isinstance(node, MultiStepsState):
            return P()
        replicated = jax.tree.map(lambda _: P(), node)
        per_device = {
            name: jax.tree.map(lambda _: P(axis_name), getattr(node, name))
            for name in PER_DEVICE_FIELDS
        }
        return replicated._replace(**per_device)

    return jax.tree.map(specs_of, opt_state, is_leaf=lambda x: isinstance(x, MultiStepsState))
