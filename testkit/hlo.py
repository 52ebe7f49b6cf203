"""Reading compiled HLO text: which operations run where, and how many bytes they move.

A compiled program (``jax.jit(f).lower(...).compile().as_text()``) is a set of
computations; each instruction sits in one. What matters for accumulation is
*when* it runs:

* ``entry``: the entry computation, on every call;
* ``loop``: the body of a while loop, at any depth (jaxaccum's boundary, which
  makes one trip per window and none in between; a scan's body);
* ``branch_small`` / ``branch_large``: the branches of a conditional, the one
  with fewer / more instructions (optax.MultiSteps' skip conditional).

Fusion and reduction computations are not roles: their instructions are
parts of one fused kernel.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")


def shape_bytes(text: str) -> int:
    """Bytes of every array type written in ``text`` (``f32[8,16]``, or a tuple of them)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


def hlo_type(x: Any) -> str:
    """The HLO spelling of an array's type, e.g. ``f32[64,256]``."""
    names = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64",
             "int32": "s32", "bool": "pred"}  # fmt: skip
    name = names.get(np.dtype(x.dtype).name, np.dtype(x.dtype).name)
    return f"{name}[{','.join(str(d) for d in x.shape)}]"


def computations(hlo_text: str) -> dict[str, list[str]]:
    """``{computation name: its instruction lines}``; the entry is under ``'ENTRY'``."""
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = "ENTRY" if line.startswith("ENTRY") else line.split("(")[0].strip("% ")
            out[current] = []
        elif current is not None and line.strip() not in ("", "}"):
            out[current].append(line)
    return out


def roles(hlo_text: str) -> dict[str, str]:
    """The role (module docstring) of each computation that is one."""
    comps = computations(hlo_text)
    found = {"ENTRY": "entry"}
    for lines in comps.values():
        for line in lines:
            body = re.search(r"\bwhile\(.*body=%?([\w.\-]+)", line)
            if body:
                found[body.group(1)] = "loop"
            names = []
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            if branches:
                names = [n.strip().lstrip("%") for n in branches.group(1).split(",")]
            pair = re.search(r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", line)
            if pair:
                names = list(pair.groups())
            if names:
                by_size = sorted(names, key=lambda n: len(comps.get(n, [])))
                found[by_size[0]] = "branch_small"
                found.update({n: "branch_large" for n in by_size[1:]})
    return found


def instructions(hlo_text: str, ops: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every instruction of the ``ops`` kinds: ``{'op', 'where', 'type', 'bytes', 'line'}``.

    ``where`` is the role of its computation; ``type`` its result type and
    ``bytes`` that type's size. Instructions outside any role are left out.
    """
    where_of = roles(hlo_text)
    pattern = re.compile(r"= (.+?) (" + "|".join(map(re.escape, ops)) + r")(?:-start)?\(")
    found = []
    for name, lines in computations(hlo_text).items():
        if name not in where_of:
            continue
        for line in lines:
            match = pattern.search(line)
            if match:
                kind = match.group(1).split("{")[0] if "(" not in match.group(1) else match.group(1)
                found.append(
                    {"op": match.group(2), "where": where_of[name], "type": kind,
                     "bytes": shape_bytes(match.group(1)), "line": line.strip()}
                )  # fmt: skip
    return found


_BOOKKEEPING = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast")


_CONTROL = ("while", "conditional", "call")  # their results are written by their bodies


def operations(hlo_text: str) -> list[dict[str, Any]]:
    """The instructions that run as an operation of their own (a fused kernel, a copy, a
    dot, a loop's test...), with their role and the bytes of their result.

    A computation's bookkeeping (parameters, tuples, constants, bitcasts) is left
    out; their count is what a call launches. ``bytes`` is what the operation
    writes (an update in place of a slice writes less); a loop, conditional or
    call writes nothing of its own (its results are its computations' results).
    """
    where_of = roles(hlo_text)
    opcode = re.compile(r"= (.*?) ([a-z][\w-]*)\(")
    found = []
    for name, lines in computations(hlo_text).items():
        for line in lines if name in where_of else ():
            match = opcode.search(line)
            if match and match.group(2) not in _BOOKKEEPING:
                written = 0 if match.group(2) in _CONTROL else shape_bytes(match.group(1))
                found.append({"op": match.group(2), "where": where_of[name], "bytes": written,
                              "line": line.strip()})  # fmt: skip
    return found


def collectives(hlo_text: str) -> list[dict[str, Any]]:
    """The collectives (all-reduce, reduce-scatter, all-gather, ...) and where they run."""
    return instructions(hlo_text, COLLECTIVES)


def copies_of(hlo_text: str, like: Any) -> list[dict[str, Any]]:
    """The ``copy`` instructions whose result is shaped like a (non-scalar) leaf of ``like``."""
    import jax

    types = {hlo_type(x) for x in jax.tree.leaves(like) if x.shape}
    return [c for c in instructions(hlo_text, ("copy",)) if c["type"] in types]


def entry_fusions(hlo_text: str) -> list[str]:
    """The entry computation's fusions as ``"type kind op_name"``, sorted.

    Names and numbering are left out, so two programs that compute the same
    things on every call compare equal.
    """
    fusions = []
    for line in computations(hlo_text)["ENTRY"]:
        found = re.search(r"= (\S+) fusion\(.*kind=(\w+).*?op_name=\"([^\"]*)\"", line)
        if found:
            fusions.append(" ".join(found.groups()))
    return sorted(fusions)


def per_window(found: list[dict[str, Any]], *, k: int, accumulating: bool, field: str) -> dict:
    """``{'micro_step', 'boundary', 'window'}`` totals of ``field`` (``'count'`` or ``'bytes'``).

    A jaxaccum call between boundaries runs the entry only, the call that closes
    the window also the loop body once (``accumulating``); optax.MultiSteps runs
    the entry and its conditional's large branch on every call.
    """
    value = lambda c: 1 if field == "count" else c["bytes"]
    total = lambda wheres: sum(value(c) for c in found if c["where"] in wheres)
    if accumulating:
        micro_step, boundary = total({"entry", "branch_small"}), total({"entry", "loop"})
    else:
        micro_step = boundary = total({"entry", "branch_large"})
    return {"micro_step": micro_step, "boundary": boundary,
            "window": (k - 1) * micro_step + boundary}  # fmt: skip
