"""The JAX side's optimizer: optax's AdamW and learning-rate schedule, and the clipping.

Third-party code runs under JAX's standard promotion rules (:func:`third_party`):
optax mixes an int32 step count with float32 (AdamW's bias correction, the
schedule) and Python scalars with arrays, which the tests' strict promotion
(``conftest.py``) refuses in the project's own code. The wrapping is at the
call: the suite's code and jaxaccum around it stay strict.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxaccum._normalize import clip_by_global_norm
from parity_tests.scenarios import Optimizer


def third_party(fn: Callable) -> Callable:
    """``fn`` called under JAX's standard dtype and rank promotion (optax's, flax's code)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
            return fn(*args, **kwargs)

    return call


def standard(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``tx`` with its ``init`` and ``update`` run as :func:`third_party` code."""
    return optax.GradientTransformationExtraArgs(third_party(tx.init), third_party(tx.update))


def learning_rate(opt: Optimizer, dtype: Any = jnp.float32):
    """``opt``'s learning rate: a float, or optax's ``warmup_cosine_decay_schedule``.

    The schedule gets the update count cast to ``dtype``: optax computes in the
    count's dtype, float32 for the int32 count of ``optax.scale_by_schedule``
    even under x64 (a 5e-8 relative LR error, ~6e-7 of the parameter movement
    in the fp64 check, whose tolerance is 1e-9).
    """
    if opt.schedule == "constant":
        return opt.lr
    if opt.schedule != "warmup_cosine":
        raise ValueError(f"schedule: expected 'constant' or 'warmup_cosine', got {opt.schedule!r}")
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=opt.init_lr,
        peak_value=opt.lr,
        warmup_steps=opt.warmup,
        decay_steps=opt.decay_steps,
        end_value=opt.end_lr,
    )
    return lambda count: schedule(jnp.asarray(count, dtype))


def adamw(opt: Optimizer, dtype: Any = jnp.float32) -> optax.GradientTransformationExtraArgs:
    """``optax.adamw`` with ``opt``'s settings and schedule (run as third-party code)."""
    return standard(
        optax.adamw(
            learning_rate(opt, dtype),
            b1=opt.b1,
            b2=opt.b2,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
    )


def clip(grads: Any, max_norm: float | None) -> tuple[Any, jax.Array]:
    """The window's global-norm clipping with jaxaccum's formula (``clip_grad_norm_``'s:
    ``max_norm / (norm + 1e-6)``), and the norm before it."""
    norm = optax.tree.norm(grads)
    return clip_by_global_norm(grads, norm, max_norm)[0], norm
