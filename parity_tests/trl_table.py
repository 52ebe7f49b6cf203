"""TRL's GRPO update under every cut of its window: the invariance table, checked against TRL's code.

``python -m parity_tests.trl_table [--write docs/trl-invariance.md]`` (``make trl-audit``)
audits every loss type of TRL 1.16 (`torch_ref.audit.audit_trl_grpo`) for
``gradient_accumulation_steps`` 1, 2, 4, ``steps_per_generation`` GA and 2 GA and 1 or 2
gloo ranks, and the entropy bonus with grpo and dapo; checks each verdict and each
sequence's weight against the prediction below, read off TRL's code; prints the table and
with ``--write`` puts it into the document between its markers. Exit status 1 when a
verdict or a weight is not the predicted one.

The prediction: at ratio 1 every loss type's gradient is ``sum_i sum_t w_it (-A_i grad log
p_it)`` (cispo: times ``min(1, epsilon_high)``), plus ``sum_t c w'_it (-grad H_it)`` with an
entropy bonus ``c``; `token_weights` and `entropy_weights` give ``w_it`` and ``w'_it`` for
a run's shape (`RunShape`), DDP's mean over the ranks included. A cut is invariant when its
weights are the one-batch run's for every sequence.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import pathlib
import re
import sys
from collections.abc import Sequence

import numpy as np

import bigbatch
from parity_tests import docs_blocks
from torch_ref._audit_trl import audit_trl_grpo_cuts
from torch_ref._audit_trl_cut import (
    LOSS_TYPES,
    MAX_COMPLETION_LENGTH,
    NUM_GENERATIONS,
    WINDOW_ROWS,
    GRPOCut,
)
from torch_ref._audit_trl_report import GRPOInvarianceReport

ENTROPY_COEF = 0.5
ENTROPY_LOSS_TYPES = ("grpo", "dapo")
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "trl-invariance.md"
BLOCK = "trl-table"  # the block of DOC that `make trl-audit` writes (parity_tests.docs_blocks)
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


def table_cuts() -> list[GRPOCut]:
    """Every cut of the table: loss type (then the entropy bonus), R, spg / GA, GA."""
    grid = [(ranks, factor, k) for ranks in (1, 2) for factor in (1, 2) for k in (1, 2, 4)]
    cuts = [GRPOCut(lt, k, factor * k, ranks) for lt in LOSS_TYPES for ranks, factor, k in grid]
    return cuts + [
        GRPOCut(lt, k, factor * k, ranks, ENTROPY_COEF)
        for lt in ENTROPY_LOSS_TYPES
        for ranks, factor, k in grid
    ]


def _weights_text(values: np.ndarray) -> str:
    """``"0.702-2.28"``: the range of the formula's weights (``"1"`` when all are 1)."""
    if np.all(np.abs(values - 1) <= EXACT):
        return "1"
    low, high = f"{np.min(values):#.3g}", f"{np.max(values):#.3g}"
    return low if low == high else f"{low}-{high}"


def _difference_text(difference: float, tolerance: float) -> str:
    return f"<= {tolerance:.0e}" if difference <= tolerance else f"{difference:.1e}"


def full_table(reports: Sequence[GRPOInvarianceReport]) -> list[str]:
    """The Markdown table, one line per cut (the formula's weights, checked by `check`)."""
    lines = [
        "| loss_type | entropy_coef | GA | spg | R | difference from one batch | invariant |"
        " weights (x one batch) | vs the token big batch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        relative, _ = predicted(r)
        c, (_, big) = r.cut, r.big_batch_differences
        cells = [
            c.loss_type, f"{c.entropy_coef:g}", str(c.gradient_accumulation_steps),
            str(c.steps_per_generation), str(c.world_size),
            _difference_text(r.worst, r.tolerance), "yes" if r.invariant else "**no**",
            _weights_text(relative), "equal" if big <= r.tolerance else f"{big:.1e}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _invariant_text(reports: Sequence) -> str:
    """``"yes"``, or ``"no (2 of 6 cuts)"``: how many cuts of the group are invariant."""
    invariant = sum(r.invariant for r in reports)
    return "yes" if invariant == len(reports) else f"**no** ({invariant} of {len(reports)} cuts)"


def summary_table(reports: Sequence[GRPOInvarianceReport]) -> list[str]:
    """One line per loss type, and the entropy bonus (with dapo): the form, where, the verdicts."""
    lines = [
        "| loss_type | weight of a token of sequence i (TRL's code) | grpo_trainer.py |"
        " invariant, spg = GA | invariant, spg = 2 GA | one batch = token big batch |",
        "|---|---|---|---|---|---|",
    ]
    for name in (*LOSS_TYPES, "entropy"):
        loss_type, coef = ("dapo", ENTROPY_COEF) if name == "entropy" else (name, 0.0)
        group = [r for r in reports if (r.cut.loss_type, r.cut.entropy_coef) == (loss_type, coef)]
        same = [r for r in group if r.cut.steps_per_generation == r.cut.gradient_accumulation_steps]
        double = [r for r in group if r not in same]
        one_is_big = group[0].big_batch_differences[0] <= group[0].tolerance
        label = f"dapo + entropy bonus (c = {coef:g})" if name == "entropy" else name
        cells = [label, *FORMS[name], _invariant_text(same), _invariant_text(double)]
        lines.append("| " + " | ".join([*cells, "yes" if one_is_big else "no"]) + " |")
    return lines


def rows_line(reports: Sequence[GRPOInvarianceReport]) -> str:
    """What the audited updates held: sequences, tokens, the generation batches."""
    by_cut = {(r.cut.steps_per_generation > r.cut.gradient_accumulation_steps, r.cut.world_size): r
              for r in reports}  # fmt: skip
    same, r2 = by_cut[(False, 1)], by_cut[(True, 2)]
    return (
        f"Each update: {same.tokens.size} completions ({WINDOW_ROWS // NUM_GENERATIONS} prompts"
        f" x {NUM_GENERATIONS}), "
        f"{same.window_tokens:g} tokens; with spg = 2 GA the generation batch holds"
        f" {by_cut[(True, 1)].generation_tokens:g}, and on 2 ranks the first update is other"
        f" rows ({r2.window_tokens:g} tokens, TRL deals each rank its share of the generation)."
    )


def section(reports: Sequence[GRPOInvarianceReport], today: datetime.date | None = None) -> str:
    """The generated part of the document: versions and date, both tables."""
    import torch
    import transformers
    import trl

    today = today or datetime.date.today()
    return "\n".join([
        docs_blocks.begin(BLOCK, "make trl-audit writes what follows"),
        f"Generated by `make trl-audit` on {today.isoformat()}: TRL {trl.__version__},"
        f" transformers {transformers.__version__}, torch {torch.__version__}, CPU.",
        rows_line(reports),
        "",
        *summary_table(reports),
        "",
        *full_table(reports),
        docs_blocks.end(BLOCK),
    ])  # fmt: skip


def without_date(text: str) -> str:
    """The text with the generation date blanked (what `section`'s test compares)."""
    return re.sub(r"\bon \d{4}-\d\d-\d\d\b", "on DATE", text)


def demo_cuts() -> list[GRPOCut]:
    """The parity job's lines: every loss type at GA=4 x spg=4 x R=1, then the two findings
    that break it (dapo with spg = 2 GA, the entropy bonus)."""
    return [GRPOCut(lt, 4) for lt in LOSS_TYPES] + [
        GRPOCut("dapo", 4, 8),
        GRPOCut("grpo", 4, entropy_coef=ENTROPY_COEF),
    ]


def demo_table(reports: Sequence[GRPOInvarianceReport]) -> str:
    """The parity job's table (at most 100 columns), in the style of the audit table."""
    line = "{:<14}  {:<18}  {:>10}  {:<9}  {:<13}  {}".format
    lines = [
        f"TRL GRPOTrainer: one SGD update cut into micro-batches, against one batch of the same"
        f" {WINDOW_ROWS} rows:",
        "",
        line("loss type", "cut", "difference", "invariant", "weights", "as predicted"),
        line("", "", "", "", "(x one batch)", "").rstrip(),
    ]
    for r in reports:
        name = r.cut.loss_type + (f" + {r.cut.entropy_coef:g} H" if r.cut.entropy_coef else "")
        numbers = (f"{r.worst:.1e}", "yes" if r.invariant else "NO", _weights_text(r.weights[0]))
        lines.append(line(name, r.cuts[0], *numbers, "no" if check(r) else "yes"))
    return "\n".join([
        *lines,
        "",
        "* spg: steps_per_generation; H: the entropy bonus, c x the token mean of its micro-batch.",
        "  Every loss type, GA 1/2/4, spg GA/2 GA, 1 or 2 ranks: docs/trl-invariance.md",
    ])  # fmt: skip


def demo() -> tuple[str, list[str]]:
    """The parity job's TRL table and what of it is not as predicted (`demo_cuts`); without
    TRL, a line that says so."""
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        return "TRL GRPOTrainer: not audited (pip install '.[trl]': trl, datasets)", []
    reports = run(demo_cuts(), progress=False)  # each cut's gradients take a moment: no bars
    return demo_table(reports), [problem for report in reports for problem in check(report)]


def run(cuts: Sequence[GRPOCut] | None = None, progress: bool = False) -> list:
    """The audit of every cut (default: `table_cuts`), the runs on 2 ranks in one launch."""
    return audit_trl_grpo_cuts(list(cuts or table_cuts()), timeout_s=900.0, progress=progress)


def main(argv: list[str] | None = None) -> int:
    """The table, checked; written into the document with ``--write``. Exit status 1 when a
    verdict or a weight is not the predicted one."""
    parser = argparse.ArgumentParser(prog="python -m parity_tests.trl_table")
    parser.add_argument("--write", type=pathlib.Path, nargs="?", const=DOC, default=None)
    args = parser.parse_args(argv)
    reports = run()
    generated = section(reports)
    print(generated)
    wrong = [problem for report in reports for problem in check(report)]
    for problem in wrong:
        print(f"NOT AS PREDICTED: {problem}", file=sys.stderr)
    if args.write is not None and not wrong:
        args.write.write_text(docs_blocks.replace_block(args.write.read_text(), BLOCK, generated))
        print(f"wrote {args.write}")
    print(
        f"{len(reports)} cuts, {len(wrong)} not as predicted (tolerance {bigbatch.INVARIANCE_RTOL:.0e})"
    )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
