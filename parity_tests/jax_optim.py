"""The JAX side's optimizer: optax's AdamW and its learning-rate schedule.

Third-party code runs under JAX's standard promotion rules (``testkit.standard``):
optax mixes an int32 step count with float32 (AdamW's bias correction, the
schedule) and Python scalars with arrays, which the tests' strict promotion
(``conftest.py``) refuses in the project's own code. The wrapping is at the
call: the suite's code and jaxaccum around it stay strict.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from parity_tests.scenarios import Optimizer
from testkit import standard


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
    """``optax.adamw`` with ``opt``'s settings and schedule (run as third-party code,
    ``testkit.standard``)."""
    return standard(
        optax.adamw(
            learning_rate(opt, dtype),
            b1=opt.b1,
            b2=opt.b2,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
    )
