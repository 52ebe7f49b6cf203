"""The JAX side's model: the Flax twin's parameter pytree and its summed loss, for one case.

The parameters are the real multi-leaf pytree of ``tinygpt.flax_gpt``
(``params_from_state_dict``: 26 leaves, ``params["h"][0]["attn"]["qkv"]["kernel"]``
and so on), the pytree a user hands ``jaxaccum.multi_steps``: the window sums,
the normalization, the clipping norm and AdamW all run per leaf, as they do in
training. :func:`twin` builds both from a :class:`parity_tests.cases.Case`
(its dtypes and weights, decided once there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import jaxaccum
from tinygpt import TinyGPTConfig, flax_gpt

CONFIG = TinyGPTConfig()  # the suite's model (the torch twin's, tinygpt.torch_gpt)


def twin(
    weights: dict[str, np.ndarray], unit: str, param_dtype: Any, compute_dtype: Any
) -> tuple[dict, Callable]:
    """``(params, loss_fn)``: the initial weights (torch layout, numpy) as the Flax params
    pytree in ``param_dtype``, and ``loss_fn(params, batch) -> (loss_sum, num_items)``.

    ``batch``: ``tokens``, ``labels`` ``[B, T]`` int32 and optionally ``poison`` ``[B]``,
    each row's logits multiplier (1, or +inf where an overflow is injected: its loss
    and gradient become NaN, as torch's ``inf_microbatches`` hook does).
    """
    params = flax_gpt.params_from_state_dict(weights, CONFIG, dtype=param_dtype)
    lfn = _loss_of_logits(unit)

    def loss_fn(params, batch):
        logits = flax_gpt.apply(params, batch["tokens"], CONFIG, compute_dtype=compute_dtype)
        if "poison" in batch:
            logits = logits * batch["poison"].astype(logits.dtype)[:, None, None]
        return lfn(logits, batch["labels"])

    return params, loss_fn


def _loss_of_logits(unit: str) -> Callable:
    """``(logits, labels) -> (loss_sum, num_items)`` of the unit, from ``jaxaccum.losses``
    (in at least float32, and in float64 for float64 logits)."""
    return jaxaccum.losses.causal_lm if unit == "token" else jaxaccum.losses.causal_lm_per_sample
