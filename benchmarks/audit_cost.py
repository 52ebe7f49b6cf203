"""Section 8: what the audit costs, time and peak memory against parameters, JAX and torch.

Each audit runs alone in a fresh process (``python -m benchmarks.audit_cost --one
FRAMEWORK SIZE RANKS``), so that its peak resident memory (``ru_maxrss``) is its
own: the model, the audited loop and the audit. Gloo ranks are processes of
their own; their peak is sampled (psutil, every 0.1 s) and reported apart.

The audited loop is nanoGPT's (each micro-batch's token mean / k, gradients
summed as they come), whose verdict is ``mean_of_means``; ``hf_trainer`` is
``torch_ref.audit.audit_hf_trainer`` on a ``transformers.Trainer`` (``exact``
with transformers 5.24). k = 4, 16 rows of 64 tokens of 1 to 63 valid tokens.

``make audit-gpt2`` runs the GPT-2-small rows alone and checks them against
the budget: at most 5 minutes and ``4 x`` the model's float32 bytes ``+ 1.5 GB``
each (:func:`gpt2_main`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import resource
import subprocess
import sys
import threading
import time

import numpy as np

K = 4
LEARNING_RATE = 10.0  # the update must stand 1e4 x above float32 rounding (MAX_ROUNDING)
ROWS, SEQ_LEN = 16, 64
LENGTHS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 56, 63)  # valid tokens per row
# name -> (d_model, n_layer, n_head, vocab): JAX's TinyGPT (untied head), torch's GPT-2
# (tied); 124M is GPT-2 small (torch: its 50257-token vocabulary; JAX: 25000 untied)
SIZES = {
    "1.6M": (128, 8, 4, 256),
    "5.2M": (256, 6, 8, 1024),
    "18.9M": (512, 6, 8, 256),
    "124M": (768, 12, 12, 50257),
}
JAX_124M_VOCAB = 25_000
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


def rows(vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``ROWS`` rows of ``SEQ_LEN`` token ids; row ``i`` has ``LENGTHS[i]`` next-token targets
    (its label at position 0, never a target, is set too: a count must leave it out)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (ROWS, SEQ_LEN))
    labels = np.where(np.arange(SEQ_LEN) <= np.array(LENGTHS)[:, None], ids, -100)
    return ids, labels


# ---- JAX: TinyGPT and nanoGPT's loop ----------------------------------------------------------


def jax_audit(size: str, progress: bool) -> tuple[object, int]:
    """The JAX audit of nanoGPT's loop on a TinyGPT of ``size``: (report, parameters)."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxaccum
    from tinygpt import TinyGPTConfig, flax_gpt

    d, n_layer, n_head, vocab = SIZES[size]
    vocab = JAX_124M_VOCAB if size == "124M" else vocab
    config = TinyGPTConfig(vocab_size=vocab, block_size=SEQ_LEN, n_layer=n_layer,
                           n_head=n_head, d_model=d)  # fmt: skip
    params = _jax_params(config)

    def loss_fn(params, batch):  # the reference: the summed causal-LM loss and its tokens
        logits = flax_gpt.apply(params, batch["input_ids"], config)
        return jaxaccum.losses.causal_lm(logits, batch["labels"])

    def nanogpt(params, microbatches, optimizer):  # mean loss / k, gradients summed as they come
        k = len(microbatches)

        @functools.partial(jax.jit, donate_argnums=0)  # the running sum, updated in place
        def accumulate(total, params, mb):
            grads = jax.grad(lambda p: jnp.divide(*loss_fn(p, mb)) / k)(params)
            return jax.tree.map(jnp.add, total, grads)

        total = jax.tree.map(jnp.zeros_like, params)
        for mb in microbatches:
            total = accumulate(total, params, mb)
        updates, _ = optimizer.update(total, optimizer.init(params), params)
        del total
        return optax.apply_updates(params, updates)

    ids, labels = rows(vocab)
    batch = {"input_ids": ids.astype(np.int32), "labels": labels.astype(np.int32)}
    report = _call(jaxaccum.audit.audit_window, nanogpt, loss_fn, params, batch, k=K,
                   learning_rate=LEARNING_RATE, progress=progress)  # fmt: skip
    return report, sum(x.size for x in jax.tree.leaves(params))


def _jax_params(config) -> dict:
    """TinyGPT's parameters, N(0, 0.02) float32, made leaf by leaf in the Flax layout (the
    weights are never held twice: the audit's memory is what is measured)."""
    import jax.numpy as jnp

    from tinygpt import weights

    rng = np.random.default_rng(0)
    params: dict = {}
    for name, shape in weights.state_dict_shapes(config).items():
        path, transpose = weights.flax_path(name)
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        shape = tuple(reversed(shape)) if transpose else tuple(shape)
        node[path[-1]] = jnp.asarray(0.02 * rng.standard_normal(shape, np.float32))
    return params


# ---- torch: GPT-2 (transformers) and nanoGPT's loop, or the Trainer --------------------------


def gpt2(size: str):
    """A ``transformers`` GPT-2 of ``size`` (124M: GPT-2 small's configuration), random
    weights, dropout off."""
    import torch
    import transformers

    d, n_layer, n_head, vocab = SIZES[size]
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=max(SEQ_LEN, 1024 if size == "124M" else SEQ_LEN),
        n_embd=d, n_layer=n_layer, n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=vocab - 1, eos_token_id=vocab - 1,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def nanogpt_torch(model, optimizer, microbatches) -> None:
    """nanoGPT's loop on a Hugging Face causal LM: each micro-batch's token mean / k."""
    from torch_ref.audit import hf_causal_lm_loss_sum

    for mb in microbatches:
        loss_sum, n = hf_causal_lm_loss_sum(model, mb)
        (loss_sum / max(n, 1) / len(microbatches)).backward()
    optimizer.step()


def torch_audit(size: str, ranks: int, loop: str, progress: bool) -> tuple[object, int]:
    """The torch audit of nanoGPT's loop, or of the Trainer, on GPT-2 of ``size``."""
    import torch

    from torch_ref import audit

    model = gpt2(size)
    vocab = SIZES[size][3]
    ids, labels = (torch.as_tensor(a) for a in rows(vocab))
    torch.set_num_threads(os.cpu_count() // ranks)
    if loop == "hf_trainer":
        hf_rows = [{"input_ids": i, "labels": y} for i, y in zip(ids, labels, strict=True)]
        report = _call(audit.audit_hf_trainer, model, hf_rows, k=K, world_size=ranks,
                       timeout_s=1800.0, learning_rate=LEARNING_RATE, progress=progress)  # fmt: skip
    else:
        batch = {"input_ids": ids, "labels": labels}
        report = _call(audit.audit_window, nanogpt_torch, audit.hf_causal_lm_loss_sum, model,
                       batch, k=K, world_size=ranks, timeout_s=1800.0,
                       learning_rate=LEARNING_RATE, progress=progress)  # fmt: skip
    return report, sum(p.numel() for p in model.parameters())


def _call(audit_fn, *args, progress: bool, **kwargs):
    """``audit_fn`` with ``progress`` where it takes one (the code before this change did not)."""
    import inspect

    if "progress" in inspect.signature(audit_fn).parameters:
        kwargs["progress"] = progress
    return audit_fn(*args, **kwargs)


# ---- one audit per process, measured from outside ---------------------------------------------


def one(framework: str, size: str, ranks: int, progress: bool) -> dict:
    """Runs one audit here; what the parent reads (this process's peak RSS included)."""
    started = time.perf_counter()
    if framework == "jax":
        report, params = jax_audit(size, progress)
    else:
        loop = "hf_trainer" if framework == "hf_trainer" else "nanogpt"
        report, params = torch_audit(size, ranks, loop, progress)
    return {
        "seconds": time.perf_counter() - started,
        "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "params": int(params),
        "verdict": report.verdict,
        "residual": float(report.residual),
    }


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
    args = parser.parse_args(argv)
    if args.record:
        record({case: measure(*case) for case in dict.fromkeys(CASES + GPT2_CASES)})
        write_block()
        print(recorded_block())
        return 0
    if args.one:
        framework, size, ranks = args.one
        print(json.dumps(one(framework, size, int(ranks), progress=sys.stderr.isatty())))
        return 0
    if args.gpt2:
        return gpt2_main()
    parser.error("pass --one FRAMEWORK SIZE RANKS, --gpt2 or --record")


if __name__ == "__main__":
    raise SystemExit(main())
