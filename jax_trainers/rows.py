"""The rows every JAX trainer is audited on, and one measured row of the table.

Sixteen rows of ``tinygpt.data``'s skew (empty responses beside 27-token ones) over
a 64-token vocabulary, 32 tokens long: the audit deals them into micro-batches whose
target tokens differ by an order of magnitude, so a per-micro-batch mean shows.
`Measured` is one line of ``docs/jax-trainers.md``'s table, as `make jax-trainers`
records it in ``docs/jax-trainers.json``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

import bigbatch
from tinygpt import data

ROWS = 16
SEQ_LEN = 32
VOCAB = 64
SEED = 0
LEARNING_RATE = 1.0
"""SGD's; the update is linear in it, and at 1 it lies far above float32 rounding."""
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
"""Nothing reaches the network: the trainers build tiny models from a config, no tokenizer."""


def skewed_rows() -> dict[str, np.ndarray]:
    """``{"input_tokens", "labels"}`` ``int32 [ROWS, SEQ_LEN]``: prompt (label -100), response,
    padding (token ``tinygpt.data.PAD_TOKEN``); a row's targets are its labels after the shift."""
    tokens, labels = data.skewed_batch(SEED, rows=ROWS, seq_len=SEQ_LEN, vocab=VOCAB)
    return {"input_tokens": tokens, "labels": labels}


def offline() -> None:
    """Sets `OFFLINE` in the environment (``setdefault``), before a trainer is imported."""
    for name, value in OFFLINE.items():
        os.environ.setdefault(name, value)


@dataclasses.dataclass(frozen=True)
class Measured:
    """One audited configuration of a trainer: what the audit found.

    Attributes:
      trainer: e.g. ``"tunix PeftTrainer"``.
      version: the package and its version, ``"google-tunix 0.1.7"``.
      config: the settings, ``"gradient_accumulation_steps=2, 1 device"``.
      route: ``"as shipped"`` or the fix (``"ExactPeftTrainer"``).
      verdict: the audit's verdict (``bigbatch`` form name, with ``", clipped once to
        c"`` for a window clipped as a whole; ``"invariant"``, ``"depends on the cut"``;
        or ``"error: ..."``).
      weights: each cell's weight in units of the big batch's ``1/N`` (device-major,
        ``None`` for a cell without items), or each row's weight in the last cut
        against the one-batch run.
      error: ``|update - big batch| / |big batch|`` (the window audit), or the worst
        difference from the one-batch update over the cuts (the invariance audit).
    """

    trainer: str
    version: str
    config: str
    route: str
    verdict: str
    weights: list[Any]
    error: float

    @classmethod
    def of_window(cls, report: bigbatch.AuditReport, **names: str) -> Measured:
        """A row from a window audit's report."""
        weights = [None if np.isnan(w) else float(w) for w in report.weights.ravel()]
        verdict = report.verdict
        if report.clipped_once:  # the window's gradient clipped as a whole, to clipped_to
            verdict += f", clipped once to {report.clipped_to:.3g}"
        return cls(verdict=verdict, weights=weights, error=float(report.update_error), **names)

    @classmethod
    def of_invariance(cls, report: bigbatch.InvarianceReport, **names: str) -> Measured:
        """A row from an invariance audit's report: the rows' weights in its last cut."""
        verdict = "invariant" if report.invariant else "depends on the cut"
        weights = []
        if report.weights is not None:
            weights = [None if np.isnan(w) else float(w) for w in report.weights[-1]]
        return cls(verdict=verdict, weights=weights, error=float(report.worst), **names)
