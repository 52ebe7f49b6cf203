"""TinyGPT in Flax NNX: the twin of ``torch_ref.TinyGPT``, weight for weight.

The two implementations share one set of weights, exchanged as a numpy
``state_dict`` in the torch layout (names ``wte.weight``, ``h.0.attn.qkv.weight``,
...; a ``Linear`` weight is ``[out, in]``). Flax keeps a ``Linear`` kernel as
``[in, out]``, so loading and exporting transpose those matrices and nothing
else.

The architecture (fixed by the project, see ``torch_ref``)::

    x = wte[tokens] + wpe[positions]
    for each layer:  x += attn(ln_1(x));  x += mlp(ln_2(x))
    attn:  q, k, v = split(qkv(x));  softmax(q k^T / sqrt(head_dim) + causal) v;  proj
    mlp:   proj(gelu_exact(fc(x)))
    logits = lm_head(ln_f(x))          # lm_head untied, no bias

Two ways to call it:

* as an NNX module: ``model = module_from_state_dict(sd); logits = model(tokens)``;
* as a pure function of a params pytree (what the optimizer path wants)::

      params = params_from_state_dict(sd)        # nested dict of arrays
      logits = apply(params, tokens)             # jit/grad/shard_map friendly
      sd2 = state_dict_from_params(params)       # back to the torch layout

Example::

    >>> import numpy as np
    >>> sd = init_state_dict(TinyGPTConfig(), seed=0)
    >>> params = params_from_state_dict(sd)
    >>> apply(params, np.zeros((1, 8), np.int32)).shape
    (1, 8, 256)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class TinyGPTConfig:
    """The TinyGPT hyper-parameters; the defaults are the project's fixed model."""

    vocab_size: int = 256  # byte-level
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    layer_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class _Attention(nnx.Module):
    def __init__(self, cfg: TinyGPTConfig, dtype, param_dtype, rngs):
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.qkv = nnx.Linear(d, 3 * d, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.proj = nnx.Linear(d, d, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        hd = d // self.n_head
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)  # output split q, k, v in that order
        q, k, v = (a.reshape(b, t, self.n_head, hd) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones((t, t), bool))
        # softmax in at least fp32 (bf16 compute keeps fp32 statistics, as torch autocast does)
        sdt = jnp.promote_types(scores.dtype, jnp.float32)
        scores = jnp.where(causal, scores.astype(sdt), -jnp.inf)
        att = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)  # heads concatenated
        return self.proj(y)


class _MLP(nnx.Module):
    def __init__(self, cfg: TinyGPTConfig, dtype, param_dtype, rngs):
        d = cfg.d_model
        self.fc = nnx.Linear(d, 4 * d, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.proj = nnx.Linear(4 * d, d, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.proj(jax.nn.gelu(self.fc(x), approximate=False))  # exact erf GELU


def _layer_norm(cfg, param_dtype, rngs):
    # Two-pass variance (use_fast_variance=False) like torch.nn.LayerNorm; statistics in
    # the parameter dtype (fp32 under bf16 compute, as autocast keeps layer_norm in fp32).
    return nnx.LayerNorm(
        cfg.d_model,
        epsilon=cfg.layer_norm_eps,
        param_dtype=param_dtype,
        dtype=param_dtype,
        use_fast_variance=False,
        rngs=rngs,
    )


class _Block(nnx.Module):
    def __init__(self, cfg: TinyGPTConfig, dtype, param_dtype, rngs):
        self.ln_1 = _layer_norm(cfg, param_dtype, rngs)
        self.attn = _Attention(cfg, dtype, param_dtype, rngs)
        self.ln_2 = _layer_norm(cfg, param_dtype, rngs)
        self.mlp = _MLP(cfg, dtype, param_dtype, rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x)).astype(x.dtype)
        return x + self.mlp(self.ln_2(x)).astype(x.dtype)


class TinyGPT(nnx.Module):
    """Pre-LN decoder-only transformer, the Flax twin of ``torch_ref.TinyGPT``.

    Args:
      config: the hyper-parameters.
      param_dtype: dtype of the parameters and of the residual stream (fp32 or fp64).
      compute_dtype: dtype of the matrix products (``None``: the parameter dtype;
        ``jnp.bfloat16`` for mixed precision). Layer norms and softmax stay in the
        parameter dtype, logits are returned in it.
      rngs: ``nnx.Rngs`` for the (throw-away) initialization; real weights come
        from :func:`params_from_state_dict`.

    Call: ``model(tokens)`` with int tokens ``[B, T]`` (``T <= block_size``) returns
    logits ``[B, T, vocab_size]``.
    """

    def __init__(
        self,
        config: TinyGPTConfig = TinyGPTConfig(),
        *,
        param_dtype=jnp.float32,
        compute_dtype=None,
        rngs: nnx.Rngs,
    ):
        cfg = config
        self.config = cfg
        self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, param_dtype=param_dtype, rngs=rngs)
        self.wpe = nnx.Embed(cfg.block_size, cfg.d_model, param_dtype=param_dtype, rngs=rngs)
        self.h = nnx.List(
            [_Block(cfg, compute_dtype, param_dtype, rngs) for _ in range(cfg.n_layer)]
        )
        self.ln_f = _layer_norm(cfg, param_dtype, rngs)
        self.lm_head = nnx.Linear(
            cfg.d_model,
            cfg.vocab_size,
            use_bias=False,
            dtype=compute_dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, tokens):
        t = tokens.shape[-1]
        if t > self.config.block_size:
            raise ValueError(
                f"tokens: sequence length {t} exceeds block_size {self.config.block_size}"
            )
        x = self.wte(tokens) + self.wpe(jnp.arange(t))[None]
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)).astype(x.dtype)


# ----------------------------------------------------------------------------------
# Pure-function view and the torch-layout exchange format.


@functools.cache
def _graphdef(config: TinyGPTConfig, param_dtype, compute_dtype):
    abstract = nnx.eval_shape(
        lambda: TinyGPT(
            config, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=nnx.Rngs(0)
        )
    )
    graphdef, state = nnx.split(abstract)
    return graphdef, state


def _torch_to_flax_name(name: str) -> tuple[tuple, bool]:
    """``h.0.attn.qkv.weight`` -> (``('h', 0, 'attn', 'qkv', 'kernel')``, transpose?)."""
    parts = name.split(".")
    if len(parts) < 2:
        return (name,), False
    path = [int(p) if p.isdigit() else p for p in parts[:-1]]
    leaf = parts[-1]
    module = parts[-2]
    if module in ("wte", "wpe"):
        return tuple(path + ["embedding"]), False
    if module.startswith("ln"):
        return tuple(path + ["scale" if leaf == "weight" else "bias"]), False
    # a Linear
    return tuple(path + ["kernel" if leaf == "weight" else "bias"]), leaf == "weight"


def params_from_state_dict(
    state_dict, config: TinyGPTConfig = TinyGPTConfig(), dtype=None, to_jax: bool = True
) -> dict:
    """Torch-layout numpy ``state_dict`` -> nested params dict for :func:`apply`.

    Linear weights ``[out, in]`` become kernels ``[in, out]``; every other array is
    copied. Raises ``KeyError``/``ValueError`` naming the entry on a missing,
    unexpected or wrongly shaped weight.

    Args:
      state_dict: mapping name -> array, as ``torch_ref.export_state_dict`` gives.
      config: the model config the weights belong to.
      dtype: cast to this dtype (``None``: keep the arrays' own dtype).
      to_jax: return jax arrays (default) or the numpy arrays.
    Returns:
      a nested dict (``params['h'][0]['attn']['qkv']['kernel']``) of arrays.
    """
    _, abstract = _graphdef(config, jnp.float32, None)
    expected = {path: leaf.shape for path, leaf in nnx.to_flat_state(abstract)}
    params: dict = {}
    seen = set()
    for name, value in state_dict.items():
        path, transpose = _torch_to_flax_name(name)
        if path not in expected:
            raise KeyError(f"state_dict: unexpected entry {name!r} for TinyGPT {config}")
        arr = np.asarray(value)
        arr = arr.T if transpose else arr
        if arr.shape != tuple(expected[path]):
            raise ValueError(
                f"state_dict[{name!r}]: shape {arr.shape} after layout change, "
                f"expected {tuple(expected[path])}"
            )
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        arr = arr if dtype is None else arr.astype(dtype)
        node[path[-1]] = jnp.asarray(arr) if to_jax else arr
        seen.add(path)
    missing = set(expected) - seen
    if missing:
        raise KeyError(
            f"state_dict: missing entries for {sorted('.'.join(map(str, p)) for p in missing)}"
        )
    return params


def state_dict_from_params(
    params, config: TinyGPTConfig = TinyGPTConfig()
) -> dict[str, np.ndarray]:
    """Nested params dict -> torch-layout numpy ``state_dict`` (inverse of the loader)."""
    _, abstract = _graphdef(config, jnp.float32, None)
    out = {}
    for path, _ in nnx.to_flat_state(abstract):
        leaf = params
        for key in path:
            leaf = leaf[key]
        arr = np.asarray(leaf)
        names = [str(p) for p in path[:-1]]
        kind = path[-1]
        if kind == "kernel":
            out[".".join(names + ["weight"])] = arr.T
        elif kind in ("embedding", "scale"):
            out[".".join(names + ["weight"])] = arr
        else:
            out[".".join(names + ["bias"])] = arr
    return out


@functools.partial(jax.jit, static_argnames=("config", "compute_dtype"))
def apply(params, tokens, config: TinyGPTConfig = TinyGPTConfig(), compute_dtype=None):
    """Logits ``[B, T, V]`` of TinyGPT with weights ``params`` (pure, jitted; grad friendly).

    The residual stream, layer norms and softmax run in the dtype of the params;
    ``compute_dtype`` (e.g. ``jnp.bfloat16``) sets the dtype of the matrix products.
    """
    param_dtype = jax.tree.leaves(params)[0].dtype
    graphdef, abstract = _graphdef(
        config,
        jnp.dtype(param_dtype).type,
        None if compute_dtype is None else jnp.dtype(compute_dtype).type,
    )
    state = jax.tree.map(lambda x: x, abstract)  # a fresh copy to fill
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)(tokens)


def module_from_state_dict(
    state_dict, config: TinyGPTConfig = TinyGPTConfig(), dtype=jnp.float32, compute_dtype=None
) -> TinyGPT:
    """An NNX :class:`TinyGPT` holding the torch-layout weights (no random init is run)."""
    model = nnx.eval_shape(
        lambda: TinyGPT(config, param_dtype=dtype, compute_dtype=compute_dtype, rngs=nnx.Rngs(0))
    )
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, params_from_state_dict(state_dict, config, dtype=dtype))
    return nnx.merge(graphdef, state)


def init_state_dict(
    config: TinyGPTConfig = TinyGPTConfig(), seed: int = 0
) -> dict[str, np.ndarray]:
    """GPT-2 style random weights in the torch layout (float64 numpy), from ``seed``.

    N(0, 0.02) for embeddings and Linear weights, 0.02/sqrt(2 n_layer) for the
    residual projections, zeros for biases, ones for layer-norm weights. The
    parity suite uses this so both frameworks start from the same numbers
    without either one's initializer being involved.
    """
    rng = np.random.default_rng(seed)
    _, abstract = _graphdef(config, jnp.float32, None)
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), nnx.to_pure_dict(abstract))
    sd = {}
    for name, arr in sorted(state_dict_from_params(zeros, config).items()):
        if name.endswith(".bias"):
            sd[name] = np.zeros(arr.shape)
        elif name.startswith("ln") or ".ln_" in name:
            sd[name] = np.ones(arr.shape)
        elif name.endswith("proj.weight"):
            sd[name] = rng.normal(0.0, 0.02 / math.sqrt(2 * config.n_layer), arr.shape)
        else:
            sd[name] = rng.normal(0.0, 0.02, arr.shape)
    return sd
