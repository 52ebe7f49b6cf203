"""Shared pieces of the benchmarks: interleaved timing, HLO reading, tables.

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
import re
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


def param_count(tree: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------
# Reading compiled HLO.

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape (``f32[8,16]``) written in ``text``."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


def computations(hlo_text: str) -> dict[str, list[str]]:
    """``{computation name: its instruction lines}``; the entry is under ``'ENTRY'``."""
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = (
                "ENTRY" if line.startswith("ENTRY") else line.split("(")[0].strip().lstrip("%")
            )
            out[current] = []
        elif current is not None and line.strip() not in ("", "}"):
            out[current].append(line)
    return out


def control_flow(hlo_text: str) -> dict[str, str]:
    """Role of each control-flow computation: ``'while_body'``, ``'branch_small'``
    or ``'branch_large'`` (the conditional's branch with fewer / more instructions).

    Fusion and reduction computations are not listed: their instructions are
    parts of a fused kernel, not separate operations.
    """
    comps = computations(hlo_text)
    roles: dict[str, str] = {}
    for lines in comps.values():
        for line in lines:
            body = re.search(r"\bwhile\(.*body=%?([\w.\-]+)", line)
            if body:
                roles[body.group(1)] = "while_body"
            names = []
            found = re.search(r"branch_computations=\{([^}]*)\}", line)
            if found:
                names = [n.strip().lstrip("%") for n in found.group(1).split(",")]
            found = re.search(
                r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", line
            )
            if found:
                names = list(found.groups())
            if names:
                sizes = sorted(names, key=lambda n: len(comps.get(n, [])))
                roles[sizes[0]] = "branch_small"
                for n in sizes[1:]:
                    roles[n] = "branch_large"
    return roles


def _is_copy_of(line: str, shapes: set[str]) -> int:
    """Bytes of a ``copy`` instruction whose result is one of ``shapes`` (else 0)."""
    found = re.search(r"= ((?:pred|[suf]\d+|bf16)\[[\d,]*\])\{[^}]*\} copy\(", line)
    if not found or found.group(1) not in shapes:
        return 0
    return shape_bytes(found.group(1))


def hlo_shape(x: Any) -> str:
    """The HLO spelling of an array's type, e.g. ``f32[64,256]``."""
    name = {
        "float32": "f32",
        "bfloat16": "bf16",
        "float16": "f16",
        "float64": "f64",
        "int32": "s32",
    }.get(np.dtype(x.dtype).name, np.dtype(x.dtype).name)
    return f"{name}[{','.join(str(d) for d in x.shape)}]"


def copy_placement(hlo_text: str, like: Any) -> dict[str, dict[str, int]]:
    """Where a compiled program copies arrays shaped like the leaves of ``like``.

    Counts ``copy`` instructions (separate memcpy-like operations, outside fused
    kernels) whose result has the shape and dtype of a leaf of ``like`` (e.g. the
    parameters; scalars are ignored), by the computation they sit in.

    Returns:
      ``{role: {'copies': n, 'bytes': b}}`` for roles ``'entry'`` (runs on every
      call), ``'while_body'``, ``'branch_small'`` and ``'branch_large'``.
    """
    shapes = {hlo_shape(x) for x in jax.tree.leaves(like) if x.shape}
    roles = control_flow(hlo_text)
    out = {
        r: {"copies": 0, "bytes": 0}
        for r in ("entry", "while_body", "branch_small", "branch_large")
    }
    for name, lines in computations(hlo_text).items():
        role = "entry" if name == "ENTRY" else roles.get(name)
        if role is None:
            continue
        for line in lines:
            b = _is_copy_of(line, shapes)
            if b:
                out[role]["copies"] += 1
                out[role]["bytes"] += b
    return out


def all_reduces(hlo_text: str) -> dict[str, dict[str, int]]:
    """All-reduce instructions of a compiled program and their bytes, by role.

    Same roles as :func:`copy_placement`. The bytes are those of the reduced
    result (one all-reduce may carry a tuple of arrays).
    """
    roles = control_flow(hlo_text)
    out = {
        r: {"count": 0, "bytes": 0} for r in ("entry", "while_body", "branch_small", "branch_large")
    }
    for name, lines in computations(hlo_text).items():
        role = "entry" if name == "ENTRY" else roles.get(name)
        if role is None:
            continue
        for line in lines:
            found = re.search(r"= (.*?) all-reduce(?:-start)?\(", line)
            if found:
                out[role]["count"] += 1
                out[role]["bytes"] += shape_bytes(found.group(1))
    return out


def on_paths(
    placement: dict[str, dict[str, int]], field: str, accumulating: bool
) -> tuple[int, int]:
    """``(on a micro-step's path, on the boundary's path)`` of a placement.

    jaxaccum (``accumulating``): a call between boundaries runs the entry
    computation (and a ``cond`` boundary's small, pass-through branch); the call
    that closes the window also runs the loop body once (or the ``cond``'s
    large branch). optax.MultiSteps: every call runs the entry and the large
    branch of its ``should_skip`` conditional (never skipping here).
    """
    get = lambda role: placement[role][field]
    if accumulating:
        return (
            get("entry") + get("branch_small"),
            get("entry") + get("branch_large") + get("while_body"),
        )
    every = get("entry") + get("branch_large")
    return every, every


# ----------------------------------------------------------------------------
# Markdown.


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
      data: raw figures (for tests and the JSON dump).
    """

    title: str
    body: str
    summary: list[tuple[str, str, str, bool | None]]
    data: dict[str, Any]
