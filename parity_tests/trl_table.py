"""TRL's GRPO update under every cut of its window: the invariance table, checked against TRL's code.

``python -m parity_tests.trl_table [--write docs/trl-invariance.md]`` (``make trl-audit``)
audits every loss type of TRL 1.16 (`torch_ref.audit.audit_trl_grpo`) for
``gradient_accumulation_steps`` 1, 2, 4, ``steps_per_generation`` GA and 2 GA and 1 or 2
gloo ranks, and the entropy bonus with grpo and dapo; checks each verdict and each
sequence's weight against the prediction read off TRL's code (``parity_tests.trl_prediction``);
prints the table and with ``--write`` puts it into the document between its markers. Exit
status 1 when a verdict or a weight is not the predicted one.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import pathlib
import re
import sys
from collections.abc import Sequence

import numpy as np

import bigbatch
from parity_tests import docs_blocks
from parity_tests.trl_prediction import EXACT, FORMS, check, predicted
from torch_ref._audit_trl import audit_trl_grpo_cuts
from torch_ref._audit_trl_cut import (
    LOSS_TYPES,
    NUM_GENERATIONS,
    WINDOW_ROWS,
    GRPOCut,
)
from torch_ref._audit_trl_report import GRPOInvarianceReport

ENTROPY_COEF = 0.5
ENTROPY_LOSS_TYPES = ("grpo", "dapo")
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "trl-invariance.md"
BLOCK = "trl-table"  # the block of DOC that `make trl-audit` writes (parity_tests.docs_blocks)


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
    """``"yes"``, or ``"no (invariant in 2 of 6 cuts)"``: the group's cuts that are invariant."""
    invariant = sum(r.invariant for r in reports)
    if invariant == len(reports):
        return "yes"
    return f"**no** (invariant in {invariant} of {len(reports)} cuts)"


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
