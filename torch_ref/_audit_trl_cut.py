"""The audited cut of TRL's GRPO update: the update's shape, `GRPOCut` and its checks.

The update holds `WINDOW_ROWS` completions, `NUM_GENERATIONS` of each prompt; a
cut is how ``GRPOConfig`` deals them to micro-batches, generations and ranks
(`torch_ref.audit.audit_trl_grpo`).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
"""Every ``GRPOConfig.loss_type`` of TRL 1.16 (``trl/trainer/grpo_config.py:801-835``)."""
NUM_GENERATIONS = 4
"""``num_generations``: the completions of one prompt (a group; advantages are group-normalized)."""
WINDOW_ROWS = 16
"""Completions in one optimizer update: ``per_device_train_batch_size x GA x R``."""
MAX_COMPLETION_LENGTH = 8
"""``max_completion_length``, ``dr_grpo``'s constant denominator."""
CISPO_EPSILON_HIGH = 5.0
"""``epsilon_high`` of ``cispo``: ScaleRL's value, which TRL's docstring recommends
(``grpo_config.py:184-188``). cispo weighs each token by ``min(ratio, epsilon_high)``
(``grpo_trainer.py:3109-3111``), ``min(1, epsilon_high)`` at the audited ratio 1; TRL's default
``epsilon_high = epsilon = 0.2`` (``grpo_trainer.py:945-946``) would scale cispo's update by 0.2."""


class GRPOCut(NamedTuple):
    """A cut of the audited update: ``GRPOConfig``'s window settings and the loss.

    ``epsilon_high`` None: `CISPO_EPSILON_HIGH` for cispo, else TRL's default (``epsilon``).
    """

    loss_type: str
    gradient_accumulation_steps: int
    steps_per_generation: int | None = None
    world_size: int = 1
    entropy_coef: float = 0.0
    epsilon_high: float | None = None

    @property
    def name(self) -> str:
        """``"GA=4 x spg=8 x R=2"``."""
        k, spg, ranks = self.gradient_accumulation_steps, self.steps_per_generation, self.world_size
        return f"GA={k} x spg={spg} x R={ranks}"


def check_cut(
    loss_type: Any,
    gradient_accumulation_steps: Any,
    steps_per_generation: Any = None,
    world_size: Any = 1,
    entropy_coef: Any = 0.0,
    epsilon_high: Any = None,
) -> GRPOCut:
    """The cut with its defaults resolved; a ``ValueError`` naming the argument otherwise."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    k, ranks = gradient_accumulation_steps, world_size
    for name, value in (("gradient_accumulation_steps", k), ("world_size", ranks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if WINDOW_ROWS % (k * ranks) or (WINDOW_ROWS // ranks) % NUM_GENERATIONS:
        raise ValueError(
            f"gradient_accumulation_steps, world_size: expected GA x R to divide the update's"
            f" {WINDOW_ROWS} rows, each rank's share a multiple of {NUM_GENERATIONS} (whole"
            f" prompt groups), got GA={k!r}, R={ranks!r}"
        )
    spg = k if steps_per_generation is None else steps_per_generation
    if not isinstance(spg, numbers.Integral) or isinstance(spg, bool) or spg not in (k, 2 * k):
        raise ValueError(
            f"steps_per_generation: expected None, GA ({k}) or 2 GA ({2 * k}), got"
            f" {steps_per_generation!r}"
        )
    if isinstance(entropy_coef, bool) or not isinstance(entropy_coef, int | float):
        raise ValueError(f"entropy_coef: expected a finite number, got {entropy_coef!r}")
    if not math.isfinite(entropy_coef):
        raise ValueError(f"entropy_coef: expected a finite number, got {entropy_coef!r}")
    if epsilon_high is None and loss_type == "cispo":
        epsilon_high = CISPO_EPSILON_HIGH
    if epsilon_high is not None and not (
        isinstance(epsilon_high, int | float)
        and not isinstance(epsilon_high, bool)
        and math.isfinite(epsilon_high)
        and epsilon_high > 0
    ):
        raise ValueError(f"epsilon_high: expected None or a number > 0, got {epsilon_high!r}")
    return GRPOCut(loss_type, k, int(spg), ranks, float(entropy_coef), epsilon_high)
