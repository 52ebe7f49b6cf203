"""Section 8: what the audit costs, time and peak memory against parameters, JAX and torch.

Each audit runs alone in a fresh process (``python -m benchmarks.audit_cost --one
FRAMEWORK SIZE RANKS``), so that its peak resident memory (Linux's ``VmHWM``,
``_audit_runs.peak_rss``) is its own: the model, the audited loop and the audit.
Gloo ranks are processes of their own; their peak is sampled (psutil, every
0.1 s) and reported apart.

The audited loop is nanoGPT's (each micro-batch's token mean / k, gradients
summed as they come), whose verdict is ``mean_of_means``; ``hf_trainer`` is
``torch_ref.audit.audit_hf_trainer`` on a ``transformers.Trainer`` (``exact``
with transformers 5.24). k = 4, 16 rows of 64 tokens of 1 to 63 valid tokens.

``make audit-gpt2`` runs the GPT-2-small rows alone and checks them against
the budget: at most 5 minutes and ``4 x`` the model's float32 bytes ``+ 1.5 GB``
each (:func:`gpt2_main`).

One audit, in the child: ``benchmarks/_audit_runs.py``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import threading
import time

from benchmarks._audit_runs import SIZES, one

# The budget of one GPT-2-small audit (one device): time, and memory beyond 4 x the model.
BUDGET_S = 300.0
BUDGET_EXTRA_BYTES = 1.5e9
# Before this change (commit 69feb7c: every cell's gradient as float64 on the host, an SVD of
# [P, cells]): the same cases with this module's child run on that commit, 2026-12-02, this
# 2-core machine (seconds, peak RSS bytes). At 124M that code needs ~24 GB: not run.
BEFORE = {
    ("jax", "1.6M", 1): (16.0, 1.03e9),
    ("jax", "5.2M", 1): (15.3, 1.53e9),
    ("jax", "18.9M", 1): (18.1, 3.89e9),
    ("torch", "1.6M", 1): (9.8, 0.70e9),
    ("torch", "5.2M", 1): (5.0, 1.22e9),
    ("torch", "18.9M", 1): (11.1, 3.24e9),
}
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
RECORD = DOCS / "audit-cost.json"  # the measurements, kept; docs/audit.md's block renders them
BLOCK = "audit-cost"


def measure(framework: str, size: str, ranks: int, *, env: dict | None = None) -> dict:
    """One audit in a fresh process, with the peak RSS of its gloo ranks sampled."""
    import psutil

    command = [sys.executable, "-m", "benchmarks.audit_cost", "--one", framework, size, str(ranks)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    peaks = {"ranks": 0}
    watcher = threading.Thread(target=_watch_ranks, args=(psutil.Process(process.pid), peaks))
    watcher.start()
    out, _ = process.communicate(timeout=1800)
    watcher.join()
    if process.returncode != 0:
        raise RuntimeError(f"audit {framework} {size} x{ranks} failed ({process.returncode})")
    return {**json.loads(out.strip().splitlines()[-1]), "rank_peak_bytes": peaks["ranks"]}


def _watch_ranks(parent, peaks: dict) -> None:
    """The largest RSS of any descendant (the fork server and the ranks), until ``parent`` ends."""
    import psutil

    while parent.is_running() and parent.status() != psutil.STATUS_ZOMBIE:
        try:
            for child in parent.children(recursive=True):
                peaks["ranks"] = max(peaks["ranks"], child.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.1)


# ---- the section, and the GPT-2-small target -------------------------------------------------

CASES = [("jax", size, 1) for size in SIZES] + [("torch", size, 1) for size in SIZES]
GPT2_CASES = [
    ("jax", "124M", 1),
    ("torch", "124M", 1),
    ("torch", "124M", 2),
    ("hf_trainer", "124M", 1),
    ("hf_trainer", "124M", 2),
]
# transformers 5.24 counts position 0 of GPT2LMHeadModel's rows (the rows set it: a language-modelling
# collator copies input_ids into labels), docs/audit.md
EXPECTED = {"jax": "mean_of_means", "torch": "mean_of_means", "hf_trainer": "first_label_counted"}


def budget_bytes(params: int) -> float:
    """4 x the model's float32 bytes + 1.5 GB."""
    return 4 * 4 * params + BUDGET_EXTRA_BYTES


def rows_of(results: dict) -> list[list]:
    """One table row per measured audit, with the figures before this change where known."""
    table = []
    for (framework, size, ranks), r in results.items():
        before = BEFORE.get((framework, size, ranks))
        table.append([
            framework, f"{r['params'] / 1e6:.1f}M", ranks, f"{r['seconds']:.0f}",
            f"{r['peak_bytes'] / 1e9:.2f}", f"{r['rank_peak_bytes'] / 1e9:.2f}" if ranks > 1 else "-",
            f"{r['peak_bytes'] / r['params']:.0f}", f"{budget_bytes(r['params']) / 1e9:.2f}",
            r["verdict"], "-" if before is None else f"{before[0]:.0f} s, {before[1] / 1e9:.2f} GB",
        ])  # fmt: skip
    return table


HEADER = ["audit", "parameters", "ranks", "time (s)", "peak RSS (GB)", "rank peak (GB)",
          "bytes / parameter", "budget (GB)", "verdict", "before (69feb7c)"]  # fmt: skip


def record(results: dict) -> None:
    """Adds the measured audits to ``docs/audit-cost.json`` (docs/audit.md renders it)."""
    import datetime
    import importlib.metadata

    recorded = json.loads(RECORD.read_text()) if RECORD.exists() else {"audits": {}}
    for (framework, size, ranks), result in results.items():
        recorded["audits"][f"{framework}/{size}/{ranks}"] = result
    recorded["date"] = datetime.date.today().isoformat()
    recorded["versions"] = {
        name: importlib.metadata.version(name) for name in ("jax", "torch", "transformers")
    }
    RECORD.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")


def recorded_block() -> str:
    """The table of ``docs/audit-cost.json``, as docs/audit.md's block shows it."""
    recorded = json.loads(RECORD.read_text())
    results = {}
    for case in CASES + GPT2_CASES:
        key = "/".join(str(part) for part in case)
        if key in recorded["audits"]:
            results[case] = recorded["audits"][key]
    versions = ", ".join(f"{name} {version}" for name, version in recorded["versions"].items())
    from benchmarks._common import table
    from parity_tests import docs_blocks

    caption = f"Measured on {recorded['date']}, 2 CPU cores ({versions})."
    how = "make audit-gpt2 and make bench measure what follows"
    lines = [docs_blocks.begin(BLOCK, how), table(HEADER, rows_of(results)), "", caption]
    return "\n".join([*lines, docs_blocks.end(BLOCK)])


def write_block() -> None:
    """docs/audit.md's block, rendered from the record."""
    from parity_tests import docs_blocks

    doc = DOCS / "audit.md"
    doc.write_text(docs_blocks.replace_block(doc.read_text(), BLOCK, recorded_block()))


def run(quick: bool):
    """Section 8 of ``make bench``: every size in both frameworks (quick: the smallest)."""
    from benchmarks._common import Section, table

    cases = [c for c in CASES if c[1] == "1.6M"] if quick else CASES + GPT2_CASES[2:]
    results = {case: measure(*case) for case in dict.fromkeys(cases)}
    if not quick:
        record(results)
        write_block()
    within = [
        (f"{f} {s} x{n}: peak RSS / budget", f"{r['peak_bytes'] / budget_bytes(r['params']):.2f}",
         "<= 1", r["peak_bytes"] <= budget_bytes(r["params"]))
        for (f, s, n), r in results.items()
        if n == 1
    ]  # fmt: skip
    body = "\n\n".join([__doc__.split("\n\n")[1], table(HEADER, rows_of(results))])
    data = {f"{f}/{s}/{n}": r for (f, s, n), r in results.items()}
    return Section("8. What the audit costs", body, within, data)


def gpt2_main() -> int:
    """``make audit-gpt2``: the GPT-2-small audits, each against its verdict and budget."""
    failed, results = [], {}
    print("\t".join(HEADER[:-1]), flush=True)
    for case in GPT2_CASES:
        results[case] = result = measure(*case)
        print("\t".join(str(v) for v in rows_of({case: result})[0][:-1]), flush=True)
        ok = result["verdict"] == EXPECTED[case[0]] and result["seconds"] <= BUDGET_S
        ok &= result["peak_bytes"] <= budget_bytes(result["params"])
        failed += [] if ok else [case]
    record(results)
    write_block()
    print("all within their budgets" if not failed else f"over budget or wrong: {failed}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.audit_cost")
    parser.add_argument("--one", nargs=3, metavar=("FRAMEWORK", "SIZE", "RANKS"))
    parser.add_argument("--gpt2", action="store_true", help="the GPT-2-small audits, checked")
    parser.add_argument("--record", action="store_true", help="every size, into the record")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="with --one: torch's device, and the GPU's peak memory read (JAX: its default device)",
    )
    args = parser.parse_args(argv)
    if args.record:
        record({case: measure(*case) for case in dict.fromkeys(CASES + GPT2_CASES)})
        write_block()
        print(recorded_block())
        return 0
    if args.one:
        framework, size, ranks = args.one
        progress = sys.stderr.isatty()
        print(json.dumps(one(framework, size, int(ranks), progress, args.device)))
        return 0
    if args.gpt2:
        return gpt2_main()
    parser.error("pass --one FRAMEWORK SIZE RANKS, --gpt2 or --record")


if __name__ == "__main__":
    raise SystemExit(main())
