"""Argument checks: a bad input gets an error naming the argument and what was expected.

Every check runs before anything is computed, so a refused call leaves the
optimizer state as it was. Traced values are checked for dtype and shape only;
their values are checked where they take effect (a NaN ``num_items`` makes its
window non-finite, and the window is skipped).

The checks of the factory's arguments and of each ``update`` call; what they
share: `jaxaccum._check_values` (the scalar validator), `jaxaccum._check_grads`
(the gradients against the state and the route).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxaccum import _check_grads
from jaxaccum._check_values import describe, scalar
from jaxaccum._inner import WINDOW_LOSS
from jaxaccum._sharding import AxisName, Placement
from jaxaccum._state import MultiStepsState


def one_of(value: Any, name: str, choices: tuple[Any, ...], *, where: str) -> None:
    if not any(value is c or (isinstance(value, str) and value == c) for c in choices):
        options = " or ".join(repr(c) for c in choices)
        raise ValueError(f"{where}: `{name}` must be {options}; got {value!r}.")


def instance_or_none(value: Any, name: str, cls: type, *, where: str) -> None:
    if value is not None and not isinstance(value, cls):
        raise TypeError(
            f"{where}: `{name}` must be a jaxaccum.{cls.__name__} or None; got"
            f" {type(value).__name__}."
        )


def every_k_schedule(schedule: Any) -> Callable[[jax.Array], jax.Array]:
    """``every_k_schedule`` as a function ``update_id -> int32 k``."""
    where = "multi_steps"
    if not callable(schedule):
        expected = "an int >= 1 (micro-batches per update) or a callable update_id -> int"
        ok = lambda k: k >= 1
        scalar(schedule, "every_k_schedule", where=where, kind="int", expected=expected, ok=ok)
        if not isinstance(schedule, numbers.Integral):  # a 0-d integer array
            raise TypeError(
                f"{where}: `every_k_schedule` must be {expected}; got {describe(schedule)}."
            )
        k = int(schedule)
        return lambda update_id: jnp.asarray(k, jnp.int32)
    first = schedule(jnp.asarray(0, jnp.int32))
    if not isinstance(first, jax.core.Tracer):
        scalar(
            first,
            "every_k_schedule(0)",
            where=where,
            kind="int",
            expected="an int scalar >= 1 (micro-batches per update)",
            ok=lambda k: k >= 1,
        )

    def window_size(update_id: jax.Array) -> jax.Array:
        k = schedule(update_id)
        if not jnp.issubdtype(jnp.result_type(k), jnp.integer):
            raise TypeError(
                f"{where}: `every_k_schedule` must return an int number of micro-batches;"
                f" got dtype {jnp.result_type(k)}."
            )
        return jnp.asarray(k, jnp.int32)

    return window_size


def axis_name(value: Any) -> AxisName | None:
    ok = value is None or isinstance(value, str)
    ok |= isinstance(value, tuple) and len(value) > 0 and all(isinstance(a, str) for a in value)
    if not ok:
        raise TypeError(
            "multi_steps: `axis_name` must be None, a mesh axis name (str) or a tuple of"
            f" them; got {describe(value)}."
        )
    return value


def max_grad_norm(value: Any) -> float | None:
    if value is None:
        return None
    scalar(
        value,
        "max_grad_norm",
        where="multi_steps",
        kind="real",
        expected="None or a finite number > 0",
        ok=lambda v: np.isfinite(v) and v > 0,
    )
    return float(value)


def accumulator_dtype(value: Any) -> np.dtype:
    dtype = jnp.dtype(value)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            "multi_steps: `accumulator_dtype` must be a real floating dtype (float32 by"
            f" default); got {dtype}."
        )
    return dtype


def num_items(value: Any) -> None:
    """``num_items``: required, a real scalar >= 0 (a concrete one must be finite)."""
    if value is None:
        raise TypeError(
            "multi_steps.update: `num_items` is required: the number of items (valid"
            " tokens, or samples) that the summed loss behind `grads` adds up. Pass"
            " num_items=0 for a micro-batch without any. (Flax's"
            " TrainState.apply_gradients hands its keyword arguments to .replace, not to"
            " tx.update: call tx.update yourself.)"
        )
    scalar(
        value,
        "num_items",
        where="multi_steps.update",
        kind="real",
        expected="a finite real number >= 0 (a count, or a weight, of items)",
        ok=lambda v: np.isfinite(v) and v >= 0,
    )


def update_call(
    grads_value, state, num_items_value, loss_sum, end_window, extra_args, axis_name, placement
) -> None:
    """Refuses a bad call before anything is computed: the state is never touched."""
    where = "multi_steps.update"
    if not isinstance(state, MultiStepsState):
        raise TypeError(
            f"{where}: `state` must be the MultiStepsState returned by init; got"
            f" {type(state).__name__}."
        )
    if "count" in extra_args:
        raise TypeError(
            f"{where}: `count` was renamed `num_items` in jaxaccum 0.2.0 (in optax every"
            " `count` is a step counter); pass num_items=..."
        )
    num_items(num_items_value)
    inner_extra_args(extra_args, loss_sum)
    if loss_sum is not None:
        scalar(loss_sum, "loss_sum", where=where, kind="real", expected="a real number")
    scalar(end_window, "end_window", where=where, kind="bool", expected="a bool scalar")
    _check_grads.match_state(
        grads_value,
        state.grad_sum,
        per_device=placement is Placement.PER_DEVICE,
        rows=placement is Placement.EXPLICIT,
    )
    if placement is Placement.PER_DEVICE:
        _check_grads.axis_bound(axis_name)
        _check_grads.block_norms_visible(axis_name)
        _check_grads.grads_not_summed(grads_value, axis_name)
        for name, value in {"end_window": end_window, **extra_args}.items():
            _check_grads.same_on_every_device(value, name, axis_name)
    elif placement is Placement.EXPLICIT:
        _check_grads.sums_in_rows(state, grads_value, axis_name)
        _check_grads.grads_join_without_collective(grads_value, state.grad_sum, axis_name)
    else:
        _check_grads.grads_reduced(grads_value)


def inner_extra_args(extra_args: dict, loss_sum: Any) -> None:
    """``update``'s extra arguments reach the inner optimizer once, at the boundary: none may
    stand for one micro-batch (its loss, its gradient, a function of its rows)."""
    where = "multi_steps.update"
    value = extra_args.get("value", WINDOW_LOSS)
    if value is not WINDOW_LOSS:
        raise TypeError(
            f"{where}: `value` reaches the inner optimizer once per window, where one"
            " micro-batch's loss is not the window's: pass value=jaxaccum.WINDOW_LOSS, and"
            " the inner gets the window's mean loss (its loss_sum over its num_items, over"
            " every device), as in the big batch."
        )
    if "value" in extra_args and loss_sum is None:
        raise TypeError(f"{where}: value=jaxaccum.WINDOW_LOSS needs loss_sum= on every call.")
    for name in ("grad", "value_fn"):
        if name in extra_args:
            raise TypeError(
                f"{where}: `{name}` is for an inner optimizer with a line search (optax.lbfgs),"
                " which evaluates the objective at the parameters: a micro-batch's is not the"
                " window's. Run such an optimizer on the whole batch, without multi_steps."
            )
    for name, value in extra_args.items():
        if any(callable(leaf) for leaf in jax.tree.leaves(value)):
            raise TypeError(
                f"{where}: extra argument `{name}` holds a function: the inner optimizer would"
                " call it at the boundary on one micro-batch's rows, not the window's"
                " (optax.contrib.sam's grad_fn, sophia's obj_fn). Pass arrays and constants."
            )


def not_accumulating(inner_state: Any) -> Any:
    """Refuses an inner optimizer that accumulates too; returns its state."""
    accumulating = (optax.MultiStepsState, optax.ApplyEvery, MultiStepsState)
    nodes = jax.tree.leaves(inner_state, is_leaf=lambda x: isinstance(x, accumulating))
    if any(isinstance(x, accumulating) for x in nodes):
        raise TypeError(
            "multi_steps: `inner` accumulates micro-batches itself (optax.MultiSteps,"
            " optax.apply_every or jaxaccum.multi_steps inside it): its window would take"
            " the mean of this window's means. Pass the optimizer it wraps as `inner`, and"
            " give multi_steps the micro-batches of the whole window (every_k_schedule)."
        )
    return inner_state


def raise_if_nonfinite(overflow, micro_step, loss, grad_norm) -> None:
    """``nonfinite="raise"``: the host callback that fails a non-finite window."""
    if bool(overflow):
        raise FloatingPointError(
            "jaxaccum.multi_steps(nonfinite='raise'): the window ending at micro-step"
            f" {int(micro_step)} has a non-finite gradient or loss (loss={float(loss)},"
            f" grad_norm={float(grad_norm)}); it was not applied."
        )
