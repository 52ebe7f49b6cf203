"""4. State memory: optimizer-state bytes of jaxaccum.multi_steps vs optax.MultiSteps.

Both hold the inner optimizer's state plus one parameter-sized float32
accumulator (jaxaccum: the gradient SUM; optax: the running MEAN); the rest is
scalars (jaxaccum: counters, the window's loss sum and items, the last
window's record; optax: two counters and the skip state). Computed with
``jax.eval_shape``: nothing is allocated.
"""

from __future__ import annotations

import jax
import optax

import jaxaccum
from benchmarks._common import Section, table, tree_bytes
from benchmarks._models import Model

SMALL_DIFFERENCE = 256  # bytes: "equal up to a few scalars" (a few dozen 4-byte scalars)


def _measure(model: Model, k: int) -> dict:
    """The state bytes and leaves of both wrappers around AdamW, and of AdamW alone."""
    shapes = lambda tx: jax.eval_shape(tx.init, model.params)
    ours = shapes(jaxaccum.multi_steps(optax.adamw(1e-4), k))
    theirs = shapes(optax.MultiSteps(optax.adamw(1e-4), k))
    return {
        "model": model.name,
        "param_bytes": tree_bytes(model.params),
        "inner_bytes": tree_bytes(shapes(optax.adamw(1e-4))),
        "jaxaccum_bytes": tree_bytes(ours),
        "optax_bytes": tree_bytes(theirs),
        "jaxaccum_leaves": len(jax.tree.leaves(ours)),
        "optax_leaves": len(jax.tree.leaves(theirs)),
        "difference": tree_bytes(ours) - tree_bytes(theirs),
    }


def run(models: list[Model], *, k: int = 4) -> Section:
    """State bytes of both wrappers around AdamW (and the bare AdamW state) per model."""
    results = [_measure(model, k) for model in models]
    rows = [
        [
            r["model"],
            r["param_bytes"],
            r["inner_bytes"],
            r["jaxaccum_bytes"],
            r["optax_bytes"],
            r["difference"],
            f"{r['jaxaccum_leaves']} / {r['optax_leaves']}",
        ]
        for r in results
    ]
    body = "\n".join(
        [
            "Bytes of the optimizer state (inner AdamW), from `jax.eval_shape(tx.init, params)`.",
            "",
            table(
                [
                    "model",
                    "params",
                    "AdamW alone",
                    "jaxaccum.multi_steps",
                    "optax.MultiSteps",
                    "difference",
                    "leaves (jaxaccum / optax)",
                ],
                rows,
            ),
        ]
    )
    summary = [
        (
            f"state bytes, jaxaccum - optax.MultiSteps, {r['model'].split(' (')[0]}",
            f"{r['difference']:+d} B of {r['optax_bytes']} B",
            f"equal up to a few scalars (difference <= {SMALL_DIFFERENCE} B)",
            abs(r["difference"]) <= SMALL_DIFFERENCE,
        )
        for r in results
    ]
    return Section("4. State memory", body, summary, {"results": results})
