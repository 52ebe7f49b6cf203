"""``python -m parity_tests --device cpu|cuda [--quick] --out DIR``: the parity report.

Runs the suite (see ``parity_tests.suite``), prints the verdict first, then a
legend and the table (100 columns), and writes ``DIR/parity.md``,
``DIR/parity.json`` and ``DIR/parity_deviation.png`` (each check's worst deviation
against the tolerance band). Then the second table: the audit of the known
bugs' loops, JAX and torch (``parity_tests.audits``, ``docs/audit.md``), and the
third: TRL's GRPO update cut into micro-batches, one line per loss type
(``parity_tests.trl_table``, ``docs/trl-invariance.md``), and last the JAX trainers (Tunix,
MaxText) as ``make jax-trainers`` recorded them in their own environment
(``jax_trainers.table``, ``docs/jax-trainers.md``), labelled as recorded.

Exit status: 0 when every parity check is within tolerance, every negative
control is flagged, the audit names every loop's bug and TRL's GRPO updates are
what its code predicts and every recorded JAX trainer's verdict is the expected one; 1 otherwise (a bug variant NOT flagged is a failure
too); 2 when the requested device is not available.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys


def _configure_jax(device: str) -> None:
    """Before any JAX operation: platform, and 8 fake CPU devices for the data-parallel runs."""
    if device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        # JAX would take 75% of the GPU up front; torch (this process and its DDP ranks) needs some.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    if device == "cuda":
        # torch computes fp32 matmuls in fp32 (allow_tf32 is off by default); JAX's default GPU
        # precision may use TF32 (~1e-3 relative), which would swamp the fp32 comparison.
        jax.config.update("jax_default_matmul_precision", "highest")


def _check_cuda() -> str | None:
    """Why CUDA can't be used, or None."""
    import jax
    import torch

    problems = []
    if not torch.cuda.is_available():
        problems.append(
            "torch.cuda.is_available() is False (a CPU build of torch, or no visible GPU)"
        )
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        problems.append(f"JAX sees no GPU (backend {jax.default_backend()!r}; install jax[cuda12])")
    return "; ".join(problems) or None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m parity_tests", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: fp32 and fp64 on JAX's (8 fake) CPU devices and gloo ranks; "
        "cuda: fp32 and bf16, both frameworks on one GPU",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="three scenarios + loss scaling + all negative controls",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("out/parity"),
        help="directory for parity.md, parity.json, parity_deviation.png",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The parity report, then the audit tables; the exit status (module docstring)."""
    args = _parse(argv)
    _configure_jax(args.device)
    if args.device == "cuda":
        problem = _check_cuda()
        if problem:
            print(
                f"parity_tests: --device cuda needs a GPU visible to both JAX and torch: {problem}",
                file=sys.stderr,
            )
            return 2

    from parity_tests import audits, report, report_files, suite, trl_table

    result = suite.run_suite(args.device, args.quick, progress=not args.no_progress)
    text = report.render(result)
    print("\n".join(text.lines))
    for name, err in result.errors.items():
        print(f"FAILED RUN {name}:\n{err}", file=sys.stderr)
    paths = report_files.write(result, args.out, text)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    rows = audits.run_audits(progress=not args.no_progress)
    print()
    print(audits.table(rows))
    wrong = [
        f"{row.loop}: {row.report.verdict}, expected {row.expected}" for row in rows if not row.ok
    ]
    if wrong:
        print("FAIL: the audit misnamed " + "; ".join(wrong))
    grpo_text, grpo_wrong = trl_table.demo()
    print()
    print(grpo_text)
    if grpo_wrong:
        print("FAIL: TRL's GRPO update is not as its code predicts: " + "; ".join(grpo_wrong))
    trainers_text, trainers_wrong = _jax_trainers()
    print()
    print(trainers_text)
    return 0 if result.passed and not wrong and not grpo_wrong and not trainers_wrong else 1


def _jax_trainers() -> tuple[str, list[str]]:
    """The recorded JAX trainers' rows (their own environment runs them) and the unexpected."""
    from jax_trainers import table

    _, rows = table.recorded()
    wrong = [f"{r.trainer} {r.config}: {r.verdict}" for r in rows if not table.matches(r)]
    text = table.demo()
    if wrong:
        text += "\nFAIL: a recorded JAX trainer's verdict is not the expected one: " + "; ".join(
            wrong
        )
    return text, wrong


if __name__ == "__main__":
    sys.exit(main())
