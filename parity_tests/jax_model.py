"""The JAX side's model and numbers: dtypes, the parameter pytree, the loss, snapshots.

The parameters are the real multi-leaf pytree of ``tinygpt.flax_gpt``
(``params_from_state_dict``: 26 leaves, ``params["h"][0]["attn"]["qkv"]["kernel"]``
and so on), the pytree a user hands ``jaxaccum.multi_steps``: the window sums,
the normalization, the clipping norm and AdamW all run per leaf, as they do in
training. Snapshots go the other way, to torch-layout float64 numpy state dicts
(``tinygpt.weights.to_torch_layout``), the records both sides compare.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxaccum
from parity_tests.scenarios import Scenario
from tinygpt import TinyGPTConfig, flax_gpt
from tinygpt.weights import to_torch_layout

CONFIG = TinyGPTConfig()  # the suite's model (torch_ref.TinyGPTConfig() is the same)


def dtypes(dtype: str) -> tuple[Any, Any]:
    """``(parameter dtype, matmul compute dtype or None)`` of a scenario dtype name."""
    param = jnp.float64 if dtype == "float64" else jnp.float32
    return param, (jnp.bfloat16 if dtype == "bfloat16" else None)


def precision(scn: Scenario):
    """``jax.enable_x64`` on for fp64 scenarios (float64 arrays need it), off otherwise
    (whatever the process-wide setting, e.g. of another test module)."""
    return jax.enable_x64(scn.dtype == "float64")


def initial_params(scn: Scenario, weights: dict[str, np.ndarray]) -> dict:
    """The initial weights (torch layout, numpy) as the Flax params pytree, parameter dtype."""
    return flax_gpt.params_from_state_dict(weights, CONFIG, dtype=dtypes(scn.dtype)[0])


def loss_fn(unit: str):
    """``(logits, labels) -> (loss_sum, num_items)`` of the unit, from ``jaxaccum.losses``
    (in at least float32, and in float64 for float64 logits)."""
    lfn = jaxaccum.losses.causal_lm if unit == "token" else jaxaccum.losses.causal_lm_per_sample

    def loss(logits, labels):
        if logits.dtype == jnp.float32:
            return lfn(logits, labels)
        # jaxaccum.losses picks its compute dtype with jnp.promote_types(logits.dtype, float32),
        # which strict promotion refuses for float64 and bfloat16 logits (jaxaccum/losses.py,
        # reported); standard promotion for this call only, the same numbers.
        with jax.numpy_dtype_promotion("standard"):
            return lfn(logits, labels)

    return loss


def logits(params: dict, tokens: jax.Array, dtype: str) -> jax.Array:
    """The model's logits ``[B, T, vocab]`` under the scenario's dtype policy."""
    return flax_gpt.apply(params, tokens, CONFIG, compute_dtype=dtypes(dtype)[1])


def poisoned_loss(unit: str, dtype: str):
    """``(params, batch) -> (loss_sum, num_items)``, the logits of each row multiplied by
    ``batch["poison"]`` (1, or +inf where an overflow is injected: its loss and
    gradient become NaN, as torch_ref's ``inf_microbatches`` hook does).

    ``batch``: ``tokens``, ``labels`` ``[B, T]`` int32 and ``poison`` ``[B]``.
    """
    lfn = loss_fn(unit)

    def loss(params, batch):
        out = logits(params, batch["tokens"], dtype)
        return lfn(out * batch["poison"].astype(out.dtype)[:, None, None], batch["labels"])

    return loss


def snapshot(params: Any) -> dict[str, np.ndarray]:
    """Host params pytree -> the torch-layout float64 state dict the comparisons read."""
    torch_layout = to_torch_layout(jax.device_get(params), CONFIG)
    return {name: np.asarray(v, np.float64) for name, v in torch_layout.items()}


def record(metrics: Any) -> dict:
    """A window record (``jaxaccum.WindowMetrics`` or a dict of scalars) as Python numbers."""
    metrics = jax.device_get(metrics)
    if isinstance(metrics, jaxaccum.WindowMetrics):
        metrics = metrics._asdict()
    return {key: np.asarray(v).item() for key, v in metrics.items()}
