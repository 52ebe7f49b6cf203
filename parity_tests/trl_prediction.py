"""The prediction ``parity_tests.trl_table`` checks: each sequence's weight in TRL's GRPO update.

At ratio 1 every loss type's gradient is ``sum_i sum_t w_it (-A_i grad log
p_it)`` (cispo: times ``min(1, epsilon_high)``), plus ``sum_t c w'_it (-grad H_it)`` with an
entropy bonus ``c``; `token_weights` and `entropy_weights` give ``w_it`` and ``w'_it`` for
a run's shape (`RunShape`), DDP's mean over the ranks included. A cut is invariant when its
weights are the one-batch run's for every sequence. `check` says what of an audit's
report is not the prediction.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from torch_ref._audit_trl_cut import LOSS_TYPES, MAX_COMPLETION_LENGTH, WINDOW_ROWS
from torch_ref._audit_trl_report import GRPOInvarianceReport

WEIGHT_RTOL = 1e-4
"""A fitted weight against its formula: float32 gradients and the update read back as
``new - old`` put them ~1e-6 apart (measured up to 2e-6); the forms differ by percents."""
RESIDUAL_MAX = 1e-4
"""Each update as a reweighting of the cells' gradients: float32 rounding (~5e-7)."""
EXACT = 1e-12
"""Two formula weights are the same weight (float64 arithmetic on small integers)."""
# TRL 1.16.0's per-token weight of sequence i (grpo_trainer.py), as the docs print it
FORMS = {
    "grpo": ("1 / (rows \\|o_i\\|)", "3153-3157"),
    "sapo": ("1 / (rows \\|o_i\\|)", "3153-3157, gate slope 1 at ratio 1: 3121-3124"),
    "bnpo": ("1 / (T_mb GA R)", "3158-3162"),
    "dr_grpo": ("1 / (rows L)", "3163-3167"),
    "dapo": ("spg / (GA N_gen)", "3168-3174, N_gen: 2497-2498"),
    "cispo": ("min(1, eps_high) spg / (GA N_gen)", "3168-3174, weight: 3109-3111"),
    "vespo": ("phi_i spg / (GA N_gen), phi = 1 at ratio 1", "3168-3174, phi: 3125-3136"),
    "luspo": ("1 / rows", "3175-3182"),
    "entropy": ("c / (T_mb GA R) on each token's entropy", "3189-3211"),
}


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What one run's weights depend on, per sequence of the audited update.

    Attributes:
      tokens: ``|o_i|``, each sequence's valid completion tokens.
      microbatch_tokens: ``T_mb``, the tokens of the sequence's micro-batch on its rank.
      rows: the update's sequences, ``B GA R``.
      k: ``gradient_accumulation_steps``; spg: ``steps_per_generation``; ranks: ``R``.
      generation_tokens: ``N_gen``, the generation batch's tokens over all ranks.
      max_completion_length: ``L``.
      epsilon_high: cispo's truncation of the importance weight (1 when None).
    """

    tokens: np.ndarray
    microbatch_tokens: np.ndarray
    rows: int
    k: int
    spg: int
    ranks: int
    generation_tokens: float
    max_completion_length: int
    epsilon_high: float | None


def token_weights(loss_type: str, s: RunShape) -> np.ndarray:
    """``w_it`` of TRL 1.16's ``_compute_loss`` (``trl/trainer/grpo_trainer.py``), per sequence.

    The Trainer adds no ``1/GA`` (``loss_is_scaled_for_ga = True``, line 285) and DDP
    averages the ranks' gradients (``1/R``).
    """
    if loss_type in ("grpo", "sapo"):  # 3153-3157: row's token mean, mean over B rows, / GA
        return 1.0 / (s.rows * s.tokens)
    if loss_type == "bnpo":  # 3158-3162: micro-batch's token sum / its tokens (this rank), / GA
        return 1.0 / (s.microbatch_tokens * s.k * s.ranks)
    if loss_type == "dr_grpo":  # 3163-3167: token sum / (B max_completion_length), / GA
        return np.full(s.tokens.shape, 1.0 / (s.rows * s.max_completion_length))
    if loss_type in ("dapo", "cispo", "vespo"):
        # 3168-3174: token sum / (num_items_in_batch / R * GA / spg); num_items_in_batch: the
        # generation batch's tokens gathered over ranks (2497-2498); cispo's weight is
        # min(ratio, epsilon_high) (3109-3111), vespo's phi(1) = 1 (3125-3136, 2972-3018)
        truncation = min(1.0, s.epsilon_high or 1.0) if loss_type == "cispo" else 1.0
        return np.full(s.tokens.shape, truncation * s.spg / (s.k * s.generation_tokens))
    if loss_type == "luspo":  # 3175-3182: row's token sum, mean over B rows, / GA
        return np.full(s.tokens.shape, 1.0 / s.rows)
    raise ValueError(f"loss_type: expected one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def entropy_weights(s: RunShape) -> np.ndarray:
    """``w'_it`` of the entropy bonus (``grpo_trainer.py:3189-3211``): the micro-batch's token
    mean of the entropy on this rank, / GA, whatever the loss type; DDP's ``1/R``."""
    return 1.0 / (s.microbatch_tokens * s.k * s.ranks)


def shapes(report: GRPOInvarianceReport) -> tuple[RunShape, RunShape]:
    """The one-batch run's and the cut's `RunShape` of a report."""
    cut, tokens = report.cut, report.tokens
    cells = [tuple(c) for c in report.microbatches]
    per_cell = {c: sum(t for t, d in zip(tokens, cells, strict=True) if d == c) for c in cells}
    common = {"tokens": tokens, "rows": WINDOW_ROWS, "max_completion_length": MAX_COMPLETION_LENGTH}
    common["epsilon_high"] = cut.epsilon_high
    window = float(tokens.sum())
    one = RunShape(microbatch_tokens=np.full(tokens.shape, window), k=1, spg=1, ranks=1,
                   generation_tokens=window, **common)  # fmt: skip
    at = RunShape(
        microbatch_tokens=np.array([per_cell[c] for c in cells], np.float64),
        k=cut.gradient_accumulation_steps, spg=cut.steps_per_generation, ranks=cut.world_size,
        generation_tokens=report.generation_tokens, **common,
    )  # fmt: skip
    return one, at


def predicted(report: GRPOInvarianceReport) -> tuple[np.ndarray, np.ndarray]:
    """Each cell's predicted weight relative to the one-batch run, and relative to the token
    big batch (``1/N``, the window's tokens), in the report's cells' order."""
    one, cut = shapes(report)
    loss_type, window = report.cut.loss_type, float(report.tokens.sum())
    cut_w, one_w = [token_weights(loss_type, cut)], [token_weights(loss_type, one)]
    if report.cut.entropy_coef:
        cut_w.append(entropy_weights(cut))
        one_w.append(entropy_weights(one))
    cut_w, one_w = np.concatenate(cut_w), np.concatenate(one_w)
    return cut_w / one_w, cut_w * window


def check(report: GRPOInvarianceReport) -> list[str]:
    """What of the report is not the prediction (empty: everything is)."""
    relative, to_big = predicted(report)
    name = f"{report.cut.loss_type} (entropy_coef {report.cut.entropy_coef:g}) {report.cuts[0]}"
    wrong = []
    if report.invariant != bool(np.all(np.abs(relative - 1) <= EXACT)):
        wrong.append(f"{name}: invariant is {report.invariant}, predicted the opposite")
    if report.weights is None or not np.allclose(report.weights[0], relative, rtol=WEIGHT_RTOL):
        wrong.append(f"{name}: weights {report.weights}, predicted {relative}")
    if report.residuals is None or np.max(report.residuals) > RESIDUAL_MAX:
        wrong.append(f"{name}: residuals {report.residuals} above {RESIDUAL_MAX:.0e}")
    big = report.big_batch_differences[1] <= report.tolerance
    if big != bool(np.all(np.abs(to_big - 1) <= EXACT)):
        wrong.append(f"{name}: equal to the token big batch is {big}, predicted the opposite")
    return wrong
