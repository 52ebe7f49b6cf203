"""6. GPU: accumulation overhead against the big batch, ~100M-parameter bf16 GPT.

Selected by ``--device cuda``; a CPU run writes "not measured: no GPU in this
run". The model is the project's GPT at GPT-2-small width (12 layers,
d_model 768, 12 heads, vocabulary 8192, T = 1024: 98.4M parameters), with
bfloat16 parameters and matrix products (jaxaccum accumulates in float32).
Three programs on the same global batch, AdamW, donated buffers:

* big batch: one step on ``global_rows`` rows;
* in-step scan: ``jaxaccum.accumulate_gradients`` over ``k`` micro-batches;
* multi_steps: ``k`` jitted micro-steps through ``jaxaccum.multi_steps``.

Overhead = time / big-batch time - 1 (target <= 2%).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import _common, micro_step, scan
from benchmarks._common import Section, ms, table
from benchmarks._models import Model, gpt_config, tiny_gpt

NOT_MEASURED = "not measured: no GPU in this run"
TARGET = 0.02


def gpt_100m():
    """GPT-2-small shapes with a byte-pair-sized vocabulary: 98.4M parameters."""
    return gpt_config(d_model=768, n_layer=12, n_head=12, vocab_size=8192, block_size=1024)


def has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def run(
    device: str,
    *,
    model: Model | None = None,
    seq_len: int = 1024,
    global_rows: int = 32,
    k: int = 8,
    rounds: int = 5,
    force: bool = False,
) -> Section:
    """Measures on the GPU (or, with ``force``, on the default device: smoke tests).

    Args:
      device: ``"cuda"`` to measure; anything else writes "not measured".
      model: the model (default: :func:`gpt_100m` in bf16 with ``seq_len`` tokens).
      seq_len, global_rows, k, rounds: the global batch, micro-batches, rounds.
      force: measure even without a GPU (to test this code path on CPU).
    """
    title = "6. GPU: accumulation overhead vs big batch (~100M bf16 GPT)"
    if not force and (device != "cuda" or not has_gpu()):
        why = (
            NOT_MEASURED
            if device != "cuda"
            else NOT_MEASURED + " (--device cuda, but JAX sees no GPU)"
        )
        return Section(
            title,
            why + ".",
            [
                (
                    "accumulation overhead vs big batch, ~100M bf16 GPT",
                    NOT_MEASURED,
                    f"<= {TARGET:.0%}",
                    None,
                )
            ],
            {"measured": False},
        )
    model = model or tiny_gpt(
        gpt_100m(), seq_len=seq_len, param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16
    )
    big = scan.build(model, None, global_rows)
    scanned = scan.build(model, k, global_rows)
    window = micro_step.build(model, "jaxaccum", "adamw", True, k, global_rows // k)
    t = _common.interleaved(
        {"big batch": big, "in-step scan": scanned, "multi_steps": window.window}, rounds
    )
    res = {
        name: {
            "wall": t[name].wall,
            "overhead": _common.paired_ratio(t[name].walls, t["big batch"].walls) - 1,
        }
        for name in t
    }
    body = "\n".join(
        [
            f"{model.name}, {jax.devices()[0].device_kind}; global batch {global_rows} rows"
            f" x {model.tokens_per_row} tokens, k = {k}. Wall-clock medians over {rounds} interleaved rounds.",
            "",
            table(
                ["program", "wall ms", "overhead vs big batch"],
                [[n, ms(r["wall"]), f"{r['overhead']:+.1%}"] for n, r in res.items()],
            ),
        ]
    )
    summary = [
        (
            f"accumulation overhead vs big batch, ~100M bf16 GPT, {n}",
            f"{res[n]['overhead']:+.1%}",
            f"<= {TARGET:.0%}",
            res[n]["overhead"] <= TARGET,
        )
        for n in ("in-step scan", "multi_steps")
    ]
    return Section(title, body, summary, {"measured": True, "results": res})
