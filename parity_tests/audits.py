"""The audit of the known bugs' loops, JAX and torch, on ``tinygpt``'s twins: the second table.

Each loop runs ONE SGD update; the audit (``docs/audit.md``) fits how it weighs each cell (a
micro-batch on a rank) and names the bug. Both twins hold the torch TinyGPT's weights. The
JAX loops are ``testkit.audited_loops``' (the unit tests audit the same loops), the torch
loops ``torch_ref.buggy``'s variants of ``torch_ref.train_update``."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import bigbatch
import jaxaccum
import torch_ref
from testkit import audited_loops as loops
from testkit import standard_numerics
from tinygpt import TinyGPTConfig, flax_gpt
from tinygpt.torch_gpt import TinyGPT, export_state_dict
from tinygpt.torch_testing import skewed_batch

SEQ_LEN = 12
K = 4  # micro-batches per window; the audit's short window has K // 2
CONFIG = TinyGPTConfig(vocab_size=32, block_size=SEQ_LEN, n_layer=1, n_head=2, d_model=16)
TORCH_MODEL = TinyGPT(CONFIG, seed=0)
PARAMS = flax_gpt.params_from_state_dict(export_state_dict(TORCH_MODEL), CONFIG)
# 16 rows (ids, labels): all with tokens (one device), 4 without (2 devices: one rank's cells)
FULL = skewed_batch(0, (1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 11), SEQ_LEN, 32)
SKEWED = skewed_batch(1, (0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 8, 9, 10, 11), SEQ_LEN, 32)
HEADER = "Audit of the known bugs' loops (one SGD update each, weights x the big batch's):"
NOTES = (
    f"* a short (tail) window: {K // 2} of k = {K} micro-batches. 2 ranks: JAX's 2 devices or",
    "torch's 2 gloo ranks; 4 rows have no token. To audit your own loop: docs/audit.md",
)


def jax_loss(params: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
    """The reference of the JAX audit: the summed causal-LM loss of the Flax twin."""
    logits = flax_gpt.apply(params, batch["input_ids"], CONFIG)
    return jaxaccum.losses.causal_lm(logits, batch["labels"])


def torch_loss(model: Any, batch: dict) -> tuple[Any, Any]:
    """The reference of the torch audit: the same loss of the torch twin."""
    return torch_ref.causal_lm_loss_sum(model(batch["input_ids"]), batch["labels"])


# torch_ref's variants whose verdict is not their name, and those that need a setting
TORCH_VERDICTS = {"reference": "exact", "clip_per_microbatch": "clipped_per_micro_batch"}
TORCH_SETTINGS = {"clip_per_microbatch": {"max_grad_norm": 0.05}}  # below every micro-batch's


def torch_variant(model: Any, optimizer: Any, microbatches: list, *, name: str) -> None:
    """torch_ref's loop with the bug ``name`` (`torch_ref.buggy`; "reference": none)."""
    variant = torch_ref.buggy.variant(name)
    torch_ref.train_update(
        model, microbatches, optimizer, variant=variant, nominal_k=K, **TORCH_SETTINGS.get(name, {})
    )


@dataclasses.dataclass(frozen=True)
class AuditRow:
    """One loop's audit: who ran it, on how many ranks, the verdict it must get, the report."""

    framework: str
    loop: str
    ranks: int
    expected: str
    report: bigbatch.AuditReport

    @property
    def ok(self) -> bool:
        """Whether the audit names the loop's expected verdict."""
        return self.report.verdict == self.expected


def audit_jax(name: str, fn: Callable, rows: tuple, devices: int, expected: str) -> AuditRow:
    """The JAX audit of the loop ``fn`` (a user's code: JAX's standard numerics) on ``rows``."""

    def loop(*args):
        with standard_numerics():
            return fn(*args)

    batch = {"input_ids": rows[0].astype(np.int32), "labels": rows[1].astype(np.int32)}
    # a loop over more devices than the default backend has (one GPU): on JAX's CPU devices
    where = jax.devices()[0] if len(jax.devices()) >= devices else jax.devices("cpu")[0]
    with jax.default_device(where):
        report = jaxaccum.audit.audit_window(  # run_audits shows one bar over the audits
            loop, jax_loss, PARAMS, batch, k=K, num_devices=devices, progress=False
        )
    return AuditRow("jax", name, devices, expected, report)


def audit_torch(name: str, rows: tuple, ranks: int = 1, short: bool = False) -> AuditRow:
    """The torch audit of ``torch_ref``'s variant ``name`` (on gloo ranks if > 1): its verdict."""
    loop = functools.partial(torch_variant, name=name)
    batch = {"input_ids": rows[0], "labels": rows[1]}
    with torch_ref.one_cpu_thread():
        report = torch_ref.audit.audit_window(
            loop, torch_loss, TORCH_MODEL, batch, k=K, world_size=ranks, short_window=short,
            progress=False,
        )  # fmt: skip
    return AuditRow("torch", f"torch_ref:{name}", ranks, TORCH_VERDICTS.get(name, name), report)


# audit_jax's arguments: the table's name, the loop, its rows, devices, the verdict it must get
JAX_LOOPS = (
    ("jax optax.MultiSteps", loops.optax_multisteps(jax_loss, K), FULL, 1, "mean_of_means"),
    ("jax nanoGPT loss / k", loops.mean_of_means(jax_loss), FULL, 1, "mean_of_means"),
    ("jax forgets 1/k", loops.missing_1_over_k(jax_loss), FULL, 1, "missing_1_over_k"),
    ("jax local denominator", loops.local_denominator(jax_loss, 2), SKEWED, 2,
     "local_denominator"),
    ("jax jit, mean per micro-batch", loops.mean_of_global_means(jax_loss, 2), SKEWED, 2,
     "mean_of_global_means"),
    ("jax jaxaccum.multi_steps", loops.jaxaccum_window(jax_loss, K), FULL, 1, "exact"),
)  # fmt: skip
# audit_torch's: torch_ref.buggy's variant (the verdict it must get), rows, ranks, a short window
TORCH_LOOPS = (
    ("reference", FULL),  # "exact"
    ("mean_of_means", FULL),
    ("missing_1_over_k", FULL),
    ("fixed_divisor_tail", FULL, 1, True),
    ("local_denominator", SKEWED, 2),
    ("ddp_average_forgotten", SKEWED, 2),
    ("clip_per_microbatch", FULL),  # "clipped_per_micro_batch"
)


def run_audits(progress: bool = True) -> list[AuditRow]:
    """Audits `JAX_LOOPS`, then `TORCH_LOOPS` (a tqdm bar on stderr with ``progress``)."""
    from tqdm import tqdm

    tasks = [(audit_jax, args) for args in JAX_LOOPS] + [(audit_torch, a) for a in TORCH_LOOPS]
    rows = []
    with tqdm(tasks, unit="audit", file=sys.stderr, disable=not progress) as bar:
        for audit, args in bar:
            name = args[0] if audit is audit_jax else f"torch_ref:{args[0]}"
            bar.set_description(f"audit {name}")
            rows.append(audit(*args))
    return rows


def table(rows: Sequence[AuditRow]) -> str:
    """The audit table (at most 100 columns): the header, one line per loop, the notes."""
    line = "{:<31}  {:>5}  {:<23}  {:<13}  {:>5}  {:>8}  {}".format
    lines = [HEADER, "", line("loop", "ranks", "verdict", "weights", "scale", "residual", "ok")]
    lines.append(line("", "", "", "(x big batch)", "", "", "").rstrip())
    for row in rows:
        r, name = row.report, row.loop + " *" * row.report.short_window
        low, high = (f"{f(r.weights[~np.isnan(r.weights)]):#.3g}" for f in (np.min, np.max))
        weights = low if low == high else f"{low}-{high}"  # over the cells with items
        numbers = (weights, f"{r.scale:#.3g}", f"{r.residual:.1e}", "yes" if row.ok else "NO")
        lines.append(line(name, row.ranks, r.verdict, *numbers))
    return "\n".join([*lines, "", *NOTES])
