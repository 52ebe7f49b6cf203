"""``data_parallel.py``'s model: the tiny GPT in bfloat16 with dropout drawn per row.

``flax_gpt.TinyGPT`` with dropout after the embeddings and before the last
LayerNorm; each row's mask comes from its own key, handed to ``loss_fn`` as
``uint32`` data (``data_parallel.row_keys``), so the masks do not depend on how
many devices share the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import jaxaccum
from tinygpt import flax_gpt, weights

SEQ_LEN = 32  # the rows' length: the model's context
CONFIG = flax_gpt.TinyGPTConfig(block_size=SEQ_LEN)  # 2 layers, 4 heads, d 64


def new_params(s) -> dict:
    """The project's GPT-2 style initial weights, as a pure dict of bfloat16 numpy arrays.

    Its keys are strings (``params["h"]["0"]``), as Orbax gives them back: the
    restored parameters are the same pytree, and the compiled micro-step is reused.
    ``s``: the run's ``data_parallel.Settings`` (its ``seed`` draws the weights).
    """
    init = weights.init_state_dict(CONFIG, seed=s.seed)  # torch layout, float64
    str_keys = lambda t: {str(k): str_keys(v) for k, v in t.items()} if isinstance(t, dict) else t
    return str_keys(weights.to_flax_layout(init, CONFIG, jnp.bfloat16))


@functools.cache
def _graphdef():
    """The TinyGPT's graph and abstract state (bf16), built by shape only."""
    model = nnx.eval_shape(lambda: flax_gpt.TinyGPT(CONFIG, param_dtype=jnp.bfloat16))
    return nnx.split(model)


def dropout(x: jax.Array, row_keys: jax.Array, rate: float, site: int) -> jax.Array:
    """Inverted dropout of ``x`` [rows, ...], each row's mask from its own key (and ``site``)."""
    keys = jax.random.wrap_key_data(row_keys)  # [rows] typed keys from their uint32 data
    draw = lambda key: jax.random.bernoulli(jax.random.fold_in(key, site), 1 - rate, x.shape[1:])
    keep = jax.vmap(draw)(keys)
    return jnp.where(keep, x / jnp.asarray(1 - rate, x.dtype), jnp.zeros((), x.dtype))


def loss_fn(params: dict, batch: dict, rate: float) -> tuple[jax.Array, jax.Array]:
    """(summed token loss, valid tokens) of this device's rows, with dropout.

    ``flax_gpt.TinyGPT.__call__`` with dropout after the embeddings and before
    the last LayerNorm.
    """
    graphdef, abstract = _graphdef()
    state = jax.tree.map(lambda x: x, abstract)  # a fresh copy to fill
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    tokens, keys = batch["tokens"], batch["row_keys"]
    x = model.wte(tokens) + model.wpe(jnp.arange(tokens.shape[1]))[None]
    x = dropout(x, keys, rate, site=0)
    for block in model.h:
        x = block(x)
    x = dropout(x, keys, rate, site=1)
    logits = model.lm_head(model.ln_f(x))
    return jaxaccum.losses.causal_lm(logits, batch["labels"])
