"""What a value is, in an error's words: the one scalar validator of every argument check.

A check names the argument, who asks (``multi_steps``, ``multi_steps.update``)
and what was expected; `describe` says what came instead.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import _sharding


def _dtype_of(value: Any) -> np.dtype | None:
    """The dtype of a number or an array; None for anything else (a str, None)."""
    if isinstance(value, bool):
        return np.dtype(np.bool_)
    if isinstance(value, numbers.Integral):
        return np.dtype(np.int64)
    if isinstance(value, numbers.Real):
        return np.dtype(np.float64)
    dtype = getattr(value, "dtype", None)
    try:
        return None if dtype is None else np.dtype(dtype)
    except TypeError:
        return None


def _kind_matches(dtype: np.dtype, kind: str) -> bool:
    if kind == "bool":
        return dtype == np.bool_
    is_int = np.issubdtype(dtype, np.integer)
    if kind == "int":
        return is_int
    return is_int or jnp.issubdtype(dtype, jnp.floating)  # "real", bfloat16 included


def describe(value: Any) -> str:
    """A value in an error's words: its type and value, or its dtype and shape."""
    if isinstance(value, np.generic):
        return f"a numpy {value.dtype} scalar"
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"an array of dtype {value.dtype} and shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def scalar(
    value: Any,
    name: str,
    *,
    where: str,
    kind: str,
    expected: str,
    ok: Callable[[Any], bool] | None = None,
) -> None:
    """The one scalar validator.

    Args:
      value: a Python number, a numpy or JAX scalar, or a tracer.
      name: the argument's name, quoted in the error.
      where: who is asking (``"multi_steps.update"``), the error's prefix.
      kind: ``"real"`` (an int or a float, never a bool), ``"int"`` (never a
        bool) or ``"bool"``.
      expected: what the error says the argument must be ("a finite real
        number >= 0").
      ok: a test of the concrete value; not run for traced values.

    Raises:
      TypeError: not a number of that kind.
      ValueError: not a scalar, or ``ok`` refused the value.
    """
    dtype = _dtype_of(value)
    if dtype is None or not _kind_matches(dtype, kind):
        raise TypeError(f"{where}: `{name}` must be {expected}; got {describe(value)}.")
    if np.size(value) != 1:
        raise ValueError(f"{where}: `{name}` must be a scalar; got shape {np.shape(value)}.")
    if ok is not None and not isinstance(value, jax.core.Tracer):
        unreduced = _sharding.spec_of(value).unreduced  # a partial sum outside jit
        if unreduced:
            raise ValueError(
                f"{where}: `{name}` is a partial sum still unreduced over mesh axes"
                f" {sorted(unreduced)} (what jaxaccum.value_and_grad returns under"
                " jax.jit on a mesh): it has no value outside jit. Call update inside the"
                " jitted step that computes it."
            )
        concrete = np.asarray(value).reshape(()).item()
        if not ok(concrete):
            raise ValueError(f"{where}: `{name}` must be {expected}; got {concrete!r}.")
