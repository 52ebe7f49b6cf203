"""TinyGPT in Flax NNX, the twin of `tinygpt.torch_gpt` (the model is in `tinygpt`'s docstring).

Read it beside ``torch_gpt.py``: the same classes, attributes and order. What
differs is the framework's idiom: ``__call__`` for ``forward``; Linear kernels
[in, out] (`tinygpt.weights` maps them to torch's [out, in]); the dtype policy
as arguments: ``param_dtype`` (parameters and the residual stream) and
``compute_dtype`` (the matrix products, e.g. bfloat16), with LayerNorm and
softmax in at least float32, as ``torch.autocast`` keeps them. The LayerNorm is
written out: ``nnx.LayerNorm`` promotes dtypes implicitly, which the project's
strict dtype promotion refuses; it is the same two-pass computation.

The layers are built with zeros (no random initializer runs, so building the
model compiles nothing but a few fills); ``TinyGPT(config, seed)`` then loads
``weights.init_state_dict(config, seed)``, the numbers the torch twin loads.

Two ways to call it::

    model = TinyGPT(config, seed=0);  logits = model(input_ids)        # an NNX module
    params = params_from_state_dict(weights, config, dtype=jnp.float32)
    logits = apply(params, input_ids, config)                          # a pure function

Example:
    >>> model = TinyGPT(TinyGPTConfig(block_size=16), seed=0)
    >>> forward = nnx.jit(lambda model, ids: model(ids))  # one program, not op by op
    >>> forward(model, jnp.zeros((2, 5), jnp.int32)).shape
    (2, 5, 256)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tinygpt import TinyGPTConfig
from tinygpt.weights import init_state_dict, to_flax_layout, to_torch_layout

__all__ = [
    "MLP",
    "Block",
    "CausalSelfAttention",
    "LayerNorm",
    "TinyGPT",
    "TinyGPTConfig",
    "apply",
    "export_state_dict",
    "load_state_dict_numpy",
    "params_from_state_dict",
]

_ZEROS = nnx.initializers.zeros_init()  # every value is overwritten by _init_weights


def _at_least_f32(dtype: Any) -> Any:
    """float32 for 16-bit floats, the dtype itself otherwise (explicit: strict promotion)."""
    return jnp.float32 if jnp.finfo(dtype).bits < 32 else dtype


def _linear(d_in: int, d_out: int, dtype: Any, param_dtype: Any, bias: bool = True) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=_ZEROS,
        rngs=nnx.Rngs(0),
    )


def _embedding(n: int, d: int, param_dtype: Any) -> nnx.Embed:
    return nnx.Embed(n, d, param_dtype=param_dtype, embedding_init=_ZEROS, rngs=nnx.Rngs(0))


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention: ``softmax(q k^T / sqrt(head_dim) + causal) v``."""

    def __init__(self, config: TinyGPTConfig, dtype: Any, param_dtype: Any) -> None:
        d = config.d_model
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.qkv = _linear(d, 3 * d, dtype, param_dtype)
        self.proj = _linear(d, d, dtype, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, d] -> [B, T, d]."""
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)  # q, k, v in this order
        # [B, T, d] -> [B, T, n_head, head_dim]
        q, k, v = (a.reshape(b, t, self.n_head, self.head_dim) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((1, 1, t, t), bool))
        scores = jnp.where(causal, scores.astype(_at_least_f32(scores.dtype)), -jnp.inf)
        att = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)  # heads concatenated
        return self.proj(y)


class MLP(nnx.Module):
    """``proj(GELU(fc(x)))`` with the exact (erf) GELU, hidden width 4 d."""

    def __init__(self, config: TinyGPTConfig, dtype: Any, param_dtype: Any) -> None:
        d = config.d_model
        self.fc = _linear(d, 4 * d, dtype, param_dtype)
        self.proj = _linear(4 * d, d, dtype, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, d] -> [B, T, d]."""
        return self.proj(gelu(self.fc(x)))


@jax.custom_jvp
def gelu(x: jax.Array) -> jax.Array:
    """The exact GELU ``x Phi(x)``: ``jax.nn.gelu(x, approximate=False)``'s numbers.

    Its derivative ``Phi(x) + x phi(x)`` is written out: from jax 0.12 on, the
    automatic derivative of ``erfc`` builds a polynomial of constants that
    ``shard_map``'s vma checking refuses beside a per-device ``x`` (``ValueError:
    Primitive polynomial requires varying manual axes to match``); ``erfc`` and
    ``exp`` themselves carry the type.
    """
    return jax.nn.gelu(x, approximate=False)


@gelu.defjvp
def _gelu_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    cdf = 0.5 * jax.lax.erfc(-x * np.sqrt(0.5).astype(x.dtype))
    pdf = jnp.exp(-0.5 * x * x) * np.sqrt(0.5 / np.pi).astype(x.dtype)
    return gelu(x), dx * (cdf + x * pdf)


class LayerNorm(nnx.Module):
    """LayerNorm over d: ``(x - mean) / sqrt(biased var + eps) * scale + bias``, param dtype."""

    def __init__(self, config: TinyGPTConfig, param_dtype: Any) -> None:
        self.eps = config.layer_norm_eps
        self.scale = nnx.Param(jnp.ones((config.d_model,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((config.d_model,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., d] -> [..., d] in the parameter dtype (nnx.LayerNorm's ops, in its order)."""
        x = x.astype(_at_least_f32(x.dtype))
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)  # two-pass, biased
        features = (1,) * (x.ndim - 1) + (-1,)
        y = (x - mean) * (jax.lax.rsqrt(var + self.eps) * self.scale[...].reshape(features))
        return (y + self.bias[...].reshape(features)).astype(self.scale.dtype)


class Block(nnx.Module):
    """Pre-LN block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: TinyGPTConfig, dtype: Any, param_dtype: Any) -> None:
        self.ln_1 = LayerNorm(config, param_dtype)
        self.attn = CausalSelfAttention(config, dtype, param_dtype)
        self.ln_2 = LayerNorm(config, param_dtype)
        self.mlp = MLP(config, dtype, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, d] -> [B, T, d] (the residual stream stays in the parameter dtype)."""
        x = x + self.attn(self.ln_1(x)).astype(x.dtype)
        return x + self.mlp(self.ln_2(x)).astype(x.dtype)


class TinyGPT(nnx.Module):
    """The small causal transformer of `tinygpt`, in Flax NNX.

    Args:
      config: the shapes (the defaults: ~0.14M parameters).
      seed: the initial weights are ``weights.init_state_dict(config, seed)``.
      param_dtype: dtype of the parameters and the residual stream (float32;
        float64 needs ``jax.enable_x64``).
      compute_dtype: dtype of the matrix products (None: the parameter dtype;
        ``jnp.bfloat16`` for mixed precision). Logits come back in ``param_dtype``.
    """

    def __init__(
        self,
        config: TinyGPTConfig,
        seed: int = 0,
        *,
        param_dtype: Any = jnp.float32,
        compute_dtype: Any = None,
    ) -> None:
        self.config = config
        d = config.d_model
        self.wte = _embedding(config.vocab_size, d, param_dtype)
        self.wpe = _embedding(config.block_size, d, param_dtype)
        self.h = nnx.List(
            [Block(config, compute_dtype, param_dtype) for _ in range(config.n_layer)]
        )
        self.ln_f = LayerNorm(config, param_dtype)
        self.lm_head = _linear(d, config.vocab_size, compute_dtype, param_dtype, bias=False)
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        """Loads the GPT-2 style numpy init (the torch twin loads the same numbers)."""
        load_state_dict_numpy(self, init_state_dict(self.config, seed))

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """[B, T] int token ids -> [B, T, vocab_size] logits in the parameter dtype."""
        self.config.check_input_shape(input_ids.shape)
        t = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(jnp.arange(t))[None]
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)).astype(x.dtype)


def export_state_dict(model: TinyGPT, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """The NNX parameters as a torch-layout numpy state dict (``weights.to_torch_layout``).

    Args:
      model: a Flax TinyGPT.
      dtype: of the arrays, np.float32 (default) or np.float64.

    Returns:
      {name: array}, kernels transposed to torch's [out, in].
    """
    params = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {
        name: np.array(a, dtype=dtype) for name, a in to_torch_layout(params, model.config).items()
    }


def load_state_dict_numpy(model: TinyGPT, weights: dict[str, Any]) -> None:
    """Sets ``model``'s NNX parameters from a torch-layout state dict, in its parameter dtype.

    Args:
      model: a Flax TinyGPT (also one being built by shape under ``nnx.eval_shape``).
      weights: {name: array}, torch layout (``weights.to_flax_layout`` transposes the kernels).

    Raises:
      ValueError: missing or unexpected names, or a wrong shape; nothing is set then.
    """
    new = to_flax_layout(weights, model.config)
    state = nnx.state(model, nnx.Param)
    cast = jax.tree.map(lambda old, a: jnp.asarray(a, old.dtype), nnx.to_pure_dict(state), new)
    nnx.replace_by_pure_dict(state, cast)
    nnx.update(model, state)


def params_from_state_dict(
    weights: dict[str, Any], config: TinyGPTConfig, dtype: Any = None
) -> dict:
    """Torch-layout numpy weights -> the params pytree of `apply` (jax arrays).

    Args:
      weights: {name: array}, torch layout.
      config: the model the weights are for.
      dtype: the parameter dtype (None: each array's own dtype).

    Returns:
      ``params["h"][0]["attn"]["qkv"]["kernel"]`` and so on (`weights.to_flax_layout`).
    """
    return jax.tree.map(jnp.asarray, to_flax_layout(weights, config, dtype))


@functools.cache
def _graphdef(config: TinyGPTConfig, param_dtype: Any, compute_dtype: Any) -> tuple[Any, Any]:
    """(graphdef, abstract state) of a TinyGPT, built by shape only."""
    return nnx.split(
        nnx.eval_shape(
            lambda: TinyGPT(config, param_dtype=param_dtype, compute_dtype=compute_dtype)
        )
    )


@functools.partial(jax.jit, static_argnames=("config", "compute_dtype"))
def apply(
    params: dict, input_ids: jax.Array, config: TinyGPTConfig, compute_dtype: Any = None
) -> jax.Array:
    """Logits [B, T, V] of the TinyGPT with weights ``params``: pure, jitted, differentiable.

    Args:
      params: the pytree of `params_from_state_dict` (its dtype is the parameter dtype).
      input_ids: [B, T] int token ids.
      config: the shapes (static).
      compute_dtype: dtype of the matrix products (static; None: the parameter dtype).

    Returns:
      the logits, as ``TinyGPT(config)(input_ids)`` with these weights.
    """
    param_dtype = jnp.dtype(jax.tree.leaves(params)[0].dtype).type
    graphdef, abstract = _graphdef(
        config, param_dtype, None if compute_dtype is None else jnp.dtype(compute_dtype).type
    )
    state = jax.tree.map(lambda x: x, abstract)  # a fresh copy to fill
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)(input_ids)
