"""Small shared pieces for tests and benchmarks: a tiny LM, skewed window layouts, HLO reading.

Not part of the public API.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import losses

IGNORE_INDEX = -100


def tiny_lm_params(vocab: int = 13, hidden: int = 8, seed: int = 0) -> dict:
    """Parameters of a one-layer LM: embed -> tanh -> projection to the vocab."""
    rng = np.random.default_rng(seed)
    return {
        "embed": jnp.asarray(rng.normal(0, 0.5, (vocab, hidden)), jnp.float32),
        "proj": jnp.asarray(rng.normal(0, 0.5, (hidden, vocab)), jnp.float32),
    }


def lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """``table[tokens]``; on an Explicit mesh the rows come out sharded like ``tokens``.

    Explicit sharding asks a gather for its output sharding (and refuses to
    guess it for a ``reduced`` table): give it the tokens' batch sharding.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return table[tokens]
    spec = jax.typeof(tokens).sharding.spec
    return table.at[tokens].get(out_sharding=jax.P(*spec.partitions, None))


def tiny_lm_logits(params: dict, tokens: jax.Array) -> jax.Array:
    hidden = jnp.tanh(lookup(params["embed"], tokens).astype(jnp.float32))
    return hidden @ params["proj"].astype(jnp.float32)


def tiny_lm_loss(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """``(loss_sum, num_items)`` of a batch ``{'tokens', 'labels'}`` (token unit)."""
    return losses.causal_lm(tiny_lm_logits(params, batch["tokens"]), batch["labels"])


class Layout(NamedTuple):
    """How one window's samples are split: ``devices`` x ``k`` x ``micro_batch``."""

    devices: int
    k: int
    micro_batch: int


def skewed_windows(
    layout: Layout,
    num_windows: int,
    *,
    seq_len: int = 10,
    vocab: int = 13,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Token windows with strongly unequal valid-token counts.

    Returns ``{'tokens', 'labels'}`` of shape ``[windows, devices, k, micro_batch,
    seq_len]``. Every device holds a different number of valid tokens in every
    window, and with several devices the last one holds none; with one device
    and ``k > 1`` the first micro-batch holds none. A sample with ``n`` valid
    tokens has labels at positions ``1..n`` (the causal shift makes position 0
    never count) and ``-100`` elsewhere.
    """
    rng = np.random.default_rng(seed)
    shape = (num_windows, layout.devices, layout.k, layout.micro_batch)
    tokens = rng.integers(0, vocab, shape + (seq_len,))
    lengths = np.zeros(shape, np.int64)
    for w in range(num_windows):
        while True:
            draw = rng.integers(0, seq_len, shape[1:])
            # skew: a few long samples, many short ones
            draw = np.where(rng.random(shape[1:]) < 0.3, draw, draw // 4)
            if layout.devices > 1:
                draw[-1] = 0
            elif layout.k > 1:
                draw[0, 0] = 0
            totals = draw.reshape(layout.devices, -1).sum(axis=1)
            if len(set(totals.tolist())) == layout.devices and totals.sum() > 0:
                break
        lengths[w] = draw
    positions = np.arange(seq_len)
    valid = (positions >= 1) & (positions <= lengths[..., None])
    labels = np.where(valid, rng.integers(0, vocab, tokens.shape), IGNORE_INDEX)
    return {"tokens": tokens.astype(np.int32), "labels": labels.astype(np.int32)}


def big_batch(windows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """All samples of each window in one batch: ``[windows, samples, seq_len]``."""
    return {
        name: value.reshape(value.shape[0], -1, value.shape[-1]) for name, value in windows.items()
    }


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute elementwise difference between two pytrees (in float64)."""
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """Splits HLO module text into ``{computation name: its instruction lines}``."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            header = line.split("(")[0].replace("ENTRY", "").strip()
            current = header.lstrip("%")
            computations[current] = []
            if line.startswith("ENTRY"):
                computations["__entry__"] = computations[current]
        elif current is not None:
            computations[current].append(line)
    return computations


def all_reduce_placement(hlo_text: str) -> dict[str, Any]:
    """Where the all-reduces of a compiled program sit.

    Returns ``{'total', 'entry', 'branches': [count per branch of each
    conditional], 'loop_bodies'}``: the number of all-reduce instructions in the
    whole module, in the entry computation, in each branch computation of each
    conditional (in order), and in while-loop bodies.
    """
    import re

    computations = _computations(hlo_text)
    count = lambda name: sum(
        " all-reduce(" in line or " all-reduce-start(" in line
        for line in computations.get(name, [])
    )
    branches, bodies = [], []
    for name, lines in computations.items():
        if name == "__entry__":
            continue  # an alias of the entry computation, already visited
        for line in lines:
            found = re.search(r"branch_computations=\{([^}]*)\}", line)
            if found is None:
                found = re.search(
                    r"true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)", line
                )
                names = list(found.groups()) if found else []
            else:
                names = [n.strip().lstrip("%") for n in found.group(1).split(",")]
            if names:
                branches.append([count(n) for n in names])
            body = re.search(r"\bwhile\(.*body=%?([\w.\-]+)", line)
            if body:
                bodies.append(body.group(1))
    return {
        "total": sum(count(n) for n in computations if n != "__entry__"),
        "entry": count("__entry__"),
        "branches": branches,
        "loop_bodies": sum(count(b) for b in set(bodies)),
    }


def entry_fusions(hlo_text: str) -> list[str]:
    """The fusions of the entry computation: ``"shape kind op_name"``, sorted.

    Names and numbering are left out, so two programs that compute the same
    things on the micro-step path compare equal.
    """
    import re

    fusions = []
    for line in _computations(hlo_text)["__entry__"]:
        found = re.search(r"= (\S+) fusion\(.*kind=(\w+).*?op_name=\"([^\"]*)\"", line)
        if found:
            fusions.append(" ".join(found.groups()))
    return sorted(fusions)


COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")


def _bytes_of(shape_text: str) -> int:
    """Bytes of an HLO result type such as ``f32[8,13]{1,0}`` or a tuple of them."""
    import re

    sizes = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
             "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}  # fmt: skip
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape_text):
        count = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += sizes.get(dtype, 4) * count
    return total


def collectives(hlo_text: str) -> list[dict[str, Any]]:
    """Every collective of a compiled program: ``{'op', 'where', 'bytes'}``.

    ``where`` is ``'entry'`` (runs on every call), ``'loop'`` (inside a while
    loop's body, at any depth: jaxaccum's boundary, a scan) or ``'other'``.
    ``bytes`` is the size of its result (all elements of a tuple).
    """
    import re

    computations = _computations(hlo_text)
    bodies = set()
    for name, lines in computations.items():
        for line in lines:
            body = re.search(r"\bwhile\(.*body=%?([\w.\-]+)", line)
            if body:
                bodies.add(body.group(1))
    found = []
    for name, lines in computations.items():
        if name == "__entry__":
            continue
        where = (
            "entry" if lines is computations["__entry__"] else "loop" if name in bodies else "other"
        )
        for line in lines:
            op = re.search(r"= (.+?) (" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
            if op:
                found.append({"op": op.group(2), "where": where, "bytes": _bytes_of(op.group(1))})
    return found
