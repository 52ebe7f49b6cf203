"""Reading compiled HLO text: which operations run where, and how many bytes they move.

A compiled program (``jax.jit(f).lower(...).compile().as_text()``) is a set of
computations; each instruction sits in one. What matters for accumulation is
*when* it runs, its computation's role (:func:`roles`):

* ``entry``: the entry computation and the computations it ``call``s, on every call;
* ``loop``: the body of jaxaccum's boundary loop (the window's close), which makes
  one trip when a window closes and none in between, and the loops in it;
* ``repeated``: the body of any other while loop (a scan's, a ``fori_loop``'s, a
  zero-or-one-trip loop that is not the window's close): it runs on every call;
* ``branch_small`` / ``branch_large``: the branches of a conditional of the
  entry, the one with fewer / more instructions (optax.MultiSteps' skip
  conditional); a conditional's branches in a loop take the loop's role.

The boundary loop is told by its structure, never by its place alone:
jaxaccum's ``once_if`` is a loop of zero or one trip (its condition is a
``pred`` of its carry that its body sets to ``false``), and the window's close
is the one such loop on the entry's path whose body holds another (the inner
optimizer's update, made only for an applied window). Where none or several
fit, no loop is the boundary: each runs on every call, so a count is never
lower than the program's. ``trips`` counts the runs of a computation per call
on its path (a scan's ``known_trip_count``, multiplied through nested loops;
``None``: not known).

Fusion and reduction computations are not roles: their instructions are
parts of one fused kernel.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")  # fmt: skip
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


_OPCODE = re.compile(r"= (.*?) ([a-z][\w-]*)\(")
_WHILE = re.compile(r"\bwhile\(.*?condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")


def _opcode(line: str) -> str | None:
    """The instruction's opcode (``fusion``, ``while``, ``all-reduce``...)."""
    match = _OPCODE.search(line)
    return match.group(2) if match else None


def _called(comps: dict[str, list[str]], start: str) -> set[str]:
    """``start`` and the computations it reaches by ``call`` (they run on its path)."""
    found, todo = set(), [start]
    while todo:
        name = todo.pop()
        found.add(name)
        for line in comps.get(name, ()):
            callee = re.search(r"to_apply=%?([\w.\-]+)", line) if _opcode(line) == "call" else None
            if callee and callee.group(1) not in found:
                todo.append(callee.group(1))
    return found


def at_most_one_trip(comps: dict[str, list[str]], condition: str, body: str) -> bool:
    """The loop makes zero or one trip: its condition is a ``pred`` of its carry that its
    body sets to ``false`` (a constant, through copies and bitcasts): jaxaccum's ``once_if``."""
    root = lambda name: next((x for x in comps.get(name, ()) if x.lstrip().startswith("ROOT")), "")
    read = re.search(r"= pred\[\] get-tuple-element\(%?[\w.\-]+\), index=(\d+)", root(condition))
    carry = re.search(r" tuple\(([^)]*)\)", root(body))
    if not read or not carry:
        return False
    operands = [o.strip().lstrip("%") for o in re.sub(r"/\*.*?\*/", "", carry.group(1)).split(",")]
    defined = {m.group(1): x for x in comps[body] if (m := _NAME.search(x))}
    name = operands[int(read.group(1))]
    for _ in range(len(defined)):
        line = defined.get(name, "")
        if re.search(r"= pred\[\] constant\(false\)", line):
            return True
        hop = re.search(r" (?:copy|bitcast)\(%?([\w.\-]+)\)", line)
        if not hop:
            return False
        name = hop.group(1)
    return False


def _loops(comps: dict[str, list[str]]) -> tuple[dict[str, int | None], set[str]]:
    """``({loop body: its trips per run of its parent}, {the window's close})``: the one
    zero-or-one-trip loop on the entry's path whose body holds another; none if not one."""
    trips, once, parent = {}, set(), {}
    for name, lines in comps.items():
        for line in lines:
            loop = _WHILE.search(line)
            if loop and _opcode(line) == "while":
                condition, body = loop.groups()
                known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                trips[body] = int(known.group(1)) if known else None
                parent[body] = name
                if at_most_one_trip(comps, condition, body):
                    once.add(body)
                    trips[body] = 1
    on_entry, holders = _called(comps, "ENTRY"), {parent[body] for body in once}
    close = {body for body in once if parent[body] in on_entry and holders & _called(comps, body)}
    return trips, close if len(close) == 1 else set()


def roles(hlo_text: str) -> dict[str, tuple[str, int | None]]:
    """``{computation: (role, trips)}`` for each computation that has a role (module docstring)."""
    comps = computations(hlo_text)
    loop_trips, close = _loops(comps)
    found: dict[str, tuple[str, int | None]] = {}
    todo = [("ENTRY", "entry", 1)]
    while todo:
        name, role, trips = todo.pop()
        found[name] = (role, trips)
        for line in comps.get(name, ()):
            op, loop = _opcode(line), _WHILE.search(line)
            if op == "call":
                todo += [(n, role, trips) for n in re.findall(r"to_apply=%?([\w.\-]+)", line)]
            elif op == "while" and loop:
                body = loop.group(2)
                inner = "loop" if body in close or role == "loop" else "repeated"
                n = loop_trips[body]
                todo.append((body, inner, None if n is None or trips is None else n * trips))
            elif op == "conditional":  # in a loop: each branch as its loop (a count too high)
                branches = _branches(comps, line)
                todo += [(n, kind if role == "entry" else role, trips) for n, kind in branches]
    return found


def _branches(comps: dict[str, list[str]], line: str) -> list[tuple[str, str]]:
    """A conditional's branches, the smallest ``branch_small``, the others ``branch_large``."""
    names = []
    branches = re.search(r"branch_computations=\{([^}]*)\}", line)
    if branches:
        names = [n.strip().lstrip("%") for n in branches.group(1).split(",")]
    pair = re.search(r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", line)
    if pair:
        names = list(pair.groups())
    by_size = sorted(names, key=lambda n: len(comps.get(n, [])))
    return [(n, "branch_small" if i == 0 else "branch_large") for i, n in enumerate(by_size)]


def instructions(hlo_text: str, ops: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every instruction of the ``ops`` kinds (and their ``-start`` forms):
    ``{'op', 'where', 'trips', 'type', 'bytes', 'line'}``.

    ``where`` and ``trips`` are its computation's role and runs per call (:func:`roles`);
    ``type`` its result type and ``bytes`` that type's size. Instructions outside any
    role are left out.
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
                where, trips = where_of[name]
                found.append(
                    {"op": match.group(2), "where": where, "trips": trips, "type": kind,
                     "bytes": shape_bytes(match.group(1)), "line": line.strip()}
                )  # fmt: skip
    return found


# a ``call``'s computation runs on the caller's path (:func:`roles`): its instructions count
_BOOKKEEPING = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast", "call")


_CONTROL = ("while", "conditional")  # their results are written by their bodies


def operations(hlo_text: str) -> list[dict[str, Any]]:
    """The instructions that run as an operation of their own (a fused kernel, a copy, a
    dot, a loop's test...), with their role and the bytes of their result.

    A computation's bookkeeping (parameters, tuples, constants, bitcasts, the
    ``call`` of a computation whose instructions count on their own) is left out;
    their count is what a call launches. ``bytes`` is what the operation writes (an
    update in place of a slice writes less); a loop or conditional writes nothing of
    its own (its results are its computations' results). ``where`` and ``trips``: as
    :func:`instructions`.
    """
    where_of = roles(hlo_text)
    found = []
    for name, lines in computations(hlo_text).items():
        for line in lines if name in where_of else ():
            match = _OPCODE.search(line)
            if match and match.group(2) not in _BOOKKEEPING:
                written = 0 if match.group(2) in _CONTROL else shape_bytes(match.group(1))
                where, trips = where_of[name]
                found.append({"op": match.group(2), "where": where, "trips": trips,
                              "bytes": written, "line": line.strip()})  # fmt: skip
    return found


def collectives(hlo_text: str) -> list[dict[str, Any]]:
    """The collectives (all-reduce, reduce-scatter, all-gather, ...) and where they run."""
    return instructions(hlo_text, COLLECTIVES)


def _dtype_and_size(hlo_type_text: str) -> tuple[str, int] | None:
    """``("f32", 640)`` for ``f32[1,40,16]{2,1,0}``: an array type's dtype and element count."""
    found = _SHAPE.fullmatch(hlo_type_text.split("{")[0].strip())
    if not found:
        return None
    dims = [int(d) for d in found.group(2).split(",") if d]
    return found.group(1), int(np.prod(dims)) if dims else 1


def copies_of(hlo_text: str, like: Any) -> list[dict[str, Any]]:
    """The ``copy`` instructions of a (non-scalar) leaf of ``like``, in any shape of its
    elements: the same dtype and element count, so a device's row of a sum stored by
    device (``f32[1,40,8]``, the per-device program's type), a flattened or transposed
    copy count too. A leaf's shard (FSDP, ZeRO) counts where ``like`` holds shards."""
    import jax

    sizes = {_dtype_and_size(hlo_type(x)) for x in jax.tree.leaves(like) if x.shape}
    return [c for c in instructions(hlo_text, ("copy",)) if _dtype_and_size(c["type"]) in sizes]


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
    """``{'micro_step', 'boundary', 'window'}`` totals of ``field`` (``'count'`` or ``'bytes'``),
    each instruction counted ``trips`` times (a loop of unknown trip count: ``ValueError``).

    A jaxaccum call between boundaries runs the entry and any loop other than the
    boundary (``repeated``); the call that closes the window also the boundary loop's
    body once (``accumulating``); both count every branch of a conditional of the entry
    (it may take either: a count never lower than what runs). optax.MultiSteps runs the
    entry, its loops and its skip conditional's large branch on every call.
    """

    def value(c: dict[str, Any]) -> int:
        if c["trips"] is None:
            raise ValueError(f"a loop of unknown trip count runs {c['line']}")
        return c["trips"] * (1 if field == "count" else c["bytes"])

    total = lambda wheres: sum(value(c) for c in found if c["where"] in wheres)
    if accumulating:
        micro_step = total({"entry", "repeated", "branch_small", "branch_large"})
        boundary = total({"entry", "repeated", "loop", "branch_small", "branch_large"})
    else:
        micro_step = boundary = total({"entry", "repeated", "loop", "branch_large"})
    return {"micro_step": micro_step, "boundary": boundary,
            "window": (k - 1) * micro_step + boundary}  # fmt: skip
