"""Shared pieces of the benchmarks: interleaved timing, sizes, tables.

Compiled HLO is read by ``testkit.hlo``, the project's one reader.

Timing discipline: every compared variant is compiled and run once (warm-up)
before any measurement; then the variants run in interleaved rounds (A, B, C,
A, B, C, ...; the order rotates every round so that none always runs first),
each measurement ends with ``jax.block_until_ready``, and the figure is the
median over rounds. The machine may be shared, so only ratios measured in the
same run are reported, with both wall-clock and process CPU time; a ratio is
the median over rounds of the per-round ratio (:func:`paired_ratio`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass
class Timing:
    """Medians over interleaved rounds, in seconds.

    Attributes:
      wall: median wall-clock time of one measured unit.
      cpu: median process CPU time (all threads) of one measured unit.
      walls: every round's wall time.
      cpus: every round's CPU time.
    """

    wall: float
    cpu: float
    walls: list[float]
    cpus: list[float]


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median over rounds of ``a[r] / b[r]``: each round's two variants ran back to
    back, so the ratio cancels most of the load that changes between rounds."""
    return median([x / y for x, y in zip(a, b, strict=True)])


def paired_spread(a: Sequence[float], b: Sequence[float]) -> str:
    """The lowest and highest per-round ratio ``a[r] / b[r]``, as ``"lo-hi"``."""
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def interleaved(
    units: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1
) -> dict[str, Timing]:
    """Times each ``units[name]()`` in interleaved rounds; median per name.

    Each unit must do its own work and block on its result (return value is
    passed to ``jax.block_until_ready`` too, for safety).

    Args:
      units: name -> a callable running one measured unit (e.g. one window).
      rounds: measured rounds (each runs every unit once).
      warmup: unmeasured runs of every unit first (compilation, caches).
    """
    names = list(units)
    for _ in range(warmup):
        for name in names:
            jax.block_until_ready(units[name]())
    walls = {n: [] for n in names}
    cpus = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(units[name]())
            walls[name].append(time.perf_counter() - t0)
            cpus[name].append(time.process_time() - c0)
    return {
        n: Timing(statistics.median(walls[n]), statistics.median(cpus[n]), walls[n], cpus[n])
        for n in names
    }


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def tree_bytes(tree: Any) -> int:
    """Total bytes of the array leaves of a pytree (or of its ``eval_shape``)."""
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------
# Markdown.


def temp_bytes(compiled: Any) -> int | None:
    """A compiled program's temporary buffers (XLA's buffer assignment: what a call holds
    besides its arguments and outputs), or None where the backend does not say."""
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    fmt = lambda v: (f"{v:.3g}" if isinstance(v, float) else str(v)).replace("|", "\\|")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


@dataclasses.dataclass
class Section:
    """One benchmark's result.

    Attributes:
      title: the section heading.
      body: markdown (tables, explanation).
      summary: rows ``(figure, measured, target, met)`` for the summary table;
        ``met`` is ``True``/``False``, or ``None`` for figures without a target.
      data: raw figures (for tests; ``quoted`` lists figures from other runs).
    """

    title: str
    body: str
    summary: list[tuple[str, str, str, bool | None]]
    data: dict[str, Any]
