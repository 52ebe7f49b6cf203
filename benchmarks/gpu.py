"""6. GPU: accumulation overhead against the big batch, ~100M-parameter bf16 GPT.

Selected by ``--device cuda``; a CPU run writes "not measured: no GPU in this
run" and quotes the last GPU run, recorded in ``docs/benchmarks-gpu.md`` (the
output of ``python -m benchmarks --device cuda --sections 6``;
``benchmarks/run_on_gpu.sh`` makes it). The model is the project's GPT at
GPT-2-small width (12 layers, d_model 768, 12 heads, vocabulary 8192,
T = 1024: 98.4M parameters), with bfloat16 parameters and matrix products
(jaxaccum accumulates in float32). Programs on the same global batch, AdamW,
donated buffers, each window dispatched as a training loop does (the calls
back to back, blocked on once):

* big batch: one step on ``global_rows`` rows;
* in-step scan: ``jaxaccum.accumulate_gradients`` over ``k`` micro-batches;
* multi_steps: ``k`` jitted micro-steps through ``jaxaccum.multi_steps``;
* optax.MultiSteps: the same through optax's wrapper;
* the floor: the ``k`` micro-batches' gradients alone (no sum, no optimizer);
* an experiment: multi_steps with its boundary's ``while`` loops traced as a
  ``select`` or a ``cond`` (:func:`boundary_as`), to tell whether the loops'
  condition, read back by the host on a GPU, is what costs multi_steps there.

Overhead = time / big-batch time - 1 (target <= 2%). Section 6b compares
JAX and PyTorch tokens per second on the same GPT in float32 (section 5's code).
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from benchmarks import _common, micro_step, scan
from benchmarks._common import Section, ms, table
from benchmarks._models import Model, gpt_config, tiny_gpt

NOT_MEASURED = "not measured: no GPU in this run"
FLOOR = "k gradients alone (the floor)"
EXPERIMENTS = {  # boundary_as's forms of the boundary, and their rows
    "select": "multi_steps, boundary as select (experiment)",
    "cond": "multi_steps, boundary as cond (experiment)",
}
TARGET = 0.02
RECORD = pathlib.Path(__file__).resolve().parent.parent / "docs" / "benchmarks-gpu.md"


def recorded() -> str:
    """The last GPU run's sections (``RECORD``), a heading level down; '' without one."""
    text = RECORD.read_text() if RECORD.exists() else ""
    if "## 6. GPU" not in text:
        return ""
    sections = text[text.index("## 6. GPU") :].replace("\n## ", "\n### ")
    return (
        "The last GPU run, recorded in [docs/benchmarks-gpu.md](benchmarks-gpu.md) (its date,"
        " GPU and versions at its top; docs/parity-gpu.md discusses it):\n\n#" + sections.strip()
    )


def gpt_100m():
    """GPT-2-small shapes with a byte-pair-sized vocabulary: 98.4M parameters."""
    return gpt_config(d_model=768, n_layer=12, n_head=12, vocab_size=8192, block_size=1024)


def programs(model: Model, global_rows: int, k: int) -> dict:
    """Each compared program's window, by name (compiled here)."""
    rows = global_rows // k
    window = micro_step.build(model, "jaxaccum", "adamw", True, k, rows)
    units = {
        "big batch": scan.build(model, None, global_rows),
        "in-step scan": scan.build(model, k, global_rows),
        "multi_steps": dispatched(window),
        micro_step.BASELINE: dispatched(micro_step.build(model, micro_step.BASELINE, "adamw",
                                                         True, k, rows)),
        FLOOR: gradients_only(model, window.batches),
    }  # fmt: skip
    for kind in EXPERIMENTS:
        with boundary_as(kind):
            units[EXPERIMENTS[kind]] = dispatched(
                micro_step.build(model, "jaxaccum", "adamw", True, k, rows)
            )
    return units


@contextlib.contextmanager
def boundary_as(kind: str) -> Iterator[None]:
    """An experiment, while a step is traced: jaxaccum's zero-or-one-trip ``while`` loops
    (``once_if``: the window's close, the inner step) as a ``select`` (the body on every
    call, as optax.MultiSteps does) or a ``cond``. XLA:GPU reads a loop's condition back to
    the host; which form keeps a GPU busy is what this measures (docs/parity-gpu.md). The
    numbers are the loop's, up to float32 rounding (bench_test)."""
    from jaxaccum import _multi_steps

    def select(pred, body, *carry):
        return jax.tree.map(lambda new, old: jnp.where(pred, new, old), body(*carry), carry)

    def cond(pred, body, *carry):
        return jax.lax.cond(pred, lambda c: tuple(body(*c)), lambda c: c, carry)

    loop, _multi_steps.once_if = _multi_steps.once_if, {"select": select, "cond": cond}[kind]
    try:
        yield
    finally:
        _multi_steps.once_if = loop


def dispatched(variant: micro_step.Variant):
    """A window of ``variant``: its ``k`` donated calls dispatched back to back and blocked on
    once, as a training loop runs them (section 1 blocks on each call to time it)."""

    def window():
        for batch in variant.batches:
            variant.params, variant.state = variant.step(variant.params, variant.state, batch)[:2]
        return variant.params

    return window


def gradients_only(model: Model, batches: list):
    """The floor of any accumulation: the ``k`` micro-batches' gradients, each computed and
    dropped (no sum, no optimizer). Above the big batch, it is the cost of smaller matrix
    products; above it, the cost of the accumulation."""
    grad = jax.jit(jax.grad(lambda params, batch: model.loss_fn(params, batch)[0]))
    params = model.params

    def window():
        return [grad(params, batch) for batch in batches][-1]

    return window


def has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def _not_measured(title: str, device: str) -> Section:
    """Section 6 without a GPU: why, and the last GPU run's record."""
    why = NOT_MEASURED + ("" if device != "cuda" else " (--device cuda, but JAX sees no GPU)")
    body = "\n\n".join(part for part in (why + ".", recorded()) if part)
    figure = "accumulation overhead vs big batch, ~100M bf16 GPT"
    return Section(
        title, body, [(figure, NOT_MEASURED, f"<= {TARGET:.0%}", None)], {"measured": False}
    )


def _summary(res: dict, per_window: float) -> list:
    """Section 6's rows of the summary table: the target, the cost above the floor, optax."""
    compared = ("in-step scan", "multi_steps")
    over_big = [(f"accumulation overhead vs big batch, ~100M bf16 GPT, {n}",
                 f"{res[n]['overhead']:+.1%}", f"<= {TARGET:.0%}", res[n]["overhead"] <= TARGET)
                for n in compared]  # fmt: skip
    over_floor = [(f"above {FLOOR}, ~100M bf16 GPT, {n}", f"{res[n]['over_floor']:+.1%}",
                   "(informative)", None) for n in compared]  # fmt: skip
    optax_row = ("multi_steps / optax.MultiSteps per window, donated, ~100M bf16 GPT",
                 f"{per_window:.3f}",
                 "(none; informative: float32 sums against optax's bfloat16 mean)", None)  # fmt: skip
    return over_big + over_floor + [optax_row]


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
        return _not_measured(title, device)
    model = model or tiny_gpt(
        gpt_100m(), seq_len=seq_len, param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16
    )
    t = _common.interleaved(programs(model, global_rows, k), rounds)
    res = {
        name: {
            "wall": t[name].wall,
            "overhead": _common.paired_ratio(t[name].walls, t["big batch"].walls) - 1,
            "over_floor": _common.paired_ratio(t[name].walls, t[FLOOR].walls) - 1,
        }
        for name in t
    }
    body = "\n".join(
        [
            f"{model.name}, {jax.devices()[0].device_kind}; global batch {global_rows} rows"
            f" x {model.tokens_per_row} tokens, k = {k}. Wall-clock medians over {rounds} interleaved rounds.",
            "",
            table(
                ["program", "wall ms", "vs big batch", "vs the floor"],
                [
                    [n, ms(r["wall"]), f"{r['overhead']:+.1%}", f"{r['over_floor']:+.1%}"]
                    for n, r in res.items()
                ],
            ),
            "",
            "The floor (k gradients alone) is what the k smaller matrix products take in any"
            " accumulation; what a program takes above it is its accumulation's own cost.",
        ]
    )
    per_window = _common.paired_ratio(t["multi_steps"].walls, t[micro_step.BASELINE].walls)
    summary = _summary(res, per_window)
    data = {"measured": True, "results": res, "per_window_vs_optax": per_window}
    return Section(title, body, summary, data)


def jax_vs_torch(device: str, *, seq_len: int = 1024, rows: int = 4, k: int = 8, rounds: int = 5):
    """Section 5's comparison on the GPU at ~100M parameters (float32, TF32 matmuls on both
    sides: JAX's default GPU precision, and torch's ``allow_tf32`` set to match)."""
    if device != "cuda" or not has_gpu():
        return None
    import torch

    from benchmarks import jax_vs_torch as section_5

    before, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, True
    try:
        section = section_5.run(
            seq_len=seq_len, rows=rows, k=k, rounds=rounds, device=device, config=gpt_100m()
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    section.title = "6b. GPU: JAX vs PyTorch tokens per second (~100M GPT, float32 with TF32)"
    ratio = section.data["ratio"]  # wall: CPU time says little of a GPU's work
    section.summary = [("tokens per second, JAX (jaxaccum) / PyTorch (torch_ref), ~100M GPT, GPU",
                        f"{ratio:.2f}", "(none; informative)", None)]  # fmt: skip
    return section
