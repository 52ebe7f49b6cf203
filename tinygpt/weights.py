"""TinyGPT's weights as numpy: the names and layout, the initial values, the Flax view.

One set of numbers serves both models. It travels as a *state dict* in the
torch layout (``torch_gpt.TinyGPT(config).state_dict()``'s names and shapes;
``nn.Linear`` weights are [out, in], ``y = x @ W^T + b``), d = d_model::

    wte.weight                 [vocab_size, d]   token embedding
    wpe.weight                 [block_size, d]   position embedding
    h.{i}.ln_1.weight/bias     [d]
    h.{i}.attn.qkv.weight      [3d, d]   .bias [3d]   rows 0:d -> q, d:2d -> k, 2d:3d -> v
    h.{i}.attn.proj.weight     [d, d]    .bias [d]
    h.{i}.ln_2.weight/bias     [d]
    h.{i}.mlp.fc.weight        [4d, d]   .bias [4d]
    h.{i}.mlp.proj.weight      [d, 4d]   .bias [d]
    ln_f.weight/bias           [d]
    lm_head.weight             [vocab_size, d]   no bias, not tied to wte

The Flax model keeps the same numbers in a nested dict (``nnx.to_pure_dict``
of its parameters), one entry per torch name; only the Linear kernels change
layout (Flax: [in, out], the transpose)::

    torch name                      Flax path                             array
    wte.weight, wpe.weight          ("wte", "embedding"), ("wpe", ...)    the same
    h.{i}.ln_1.weight / .bias       ("h", i, "ln_1", "scale") / "bias"    the same
    h.{i}.attn.qkv.weight / .bias   ("h", i, "attn", "qkv", "kernel")     transposed / the same
    lm_head.weight                  ("lm_head", "kernel")                 transposed

Init (`init_state_dict`, GPT-2 style, from ``numpy.random.default_rng(seed)``
drawing in sorted-name order): Linear and embedding weights ~ N(0, 0.02), the
residual projections (``*.proj.weight``) ~ N(0, 0.02 / sqrt(2 n_layer)), biases
0, LayerNorm weights 1. Float64; each model casts to its parameter dtype.

Example:
    >>> sd = init_state_dict(TinyGPTConfig(), seed=0)
    >>> to_flax_layout(sd, TinyGPTConfig())["h"][0]["attn"]["qkv"]["kernel"].shape
    (64, 192)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinygpt import TinyGPTConfig

FlaxPath = tuple[str | int, ...]


def state_dict_shapes(config: TinyGPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's torch name and shape, in the torch module's registration order.

    Args:
      config: the model's shapes.

    Returns:
      {name: shape}, the table of the module docstring.
    """
    d, v = config.d_model, config.vocab_size
    block = {
        "ln_1.weight": (d,),
        "ln_1.bias": (d,),
        "attn.qkv.weight": (3 * d, d),
        "attn.qkv.bias": (3 * d,),
        "attn.proj.weight": (d, d),
        "attn.proj.bias": (d,),
        "ln_2.weight": (d,),
        "ln_2.bias": (d,),
        "mlp.fc.weight": (4 * d, d),
        "mlp.fc.bias": (4 * d,),
        "mlp.proj.weight": (d, 4 * d),
        "mlp.proj.bias": (d,),
    }
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (v, d),
        "wpe.weight": (config.block_size, d),
    }
    for i in range(config.n_layer):
        shapes.update({f"h.{i}.{name}": shape for name, shape in block.items()})
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,), "lm_head.weight": (v, d)})
    return shapes


def check_state_dict(weights: dict[str, Any], config: TinyGPTConfig) -> None:
    """Checks that ``weights`` holds exactly the names and torch shapes of ``config``.

    Args:
      weights: {name: array-like}, torch layout.
      config: the model the weights are for.

    Raises:
      ValueError: missing or unexpected names, or a shape that is not the table's.
    """
    shapes = state_dict_shapes(config)
    missing = sorted(set(shapes) - set(weights))
    extra = sorted(set(weights) - set(shapes))
    if missing or extra:
        raise ValueError(f"weights: missing names {missing}, unexpected names {extra}")
    for name, shape in shapes.items():
        got = tuple(np.shape(weights[name]))
        if got != shape:
            raise ValueError(f"weights[{name!r}]: expected shape {shape}, got {got}")


def init_state_dict(config: TinyGPTConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-2 style initial weights in the torch layout, float64, from ``seed``.

    Math: ``W ~ N(0, 0.02)`` for embeddings and Linear weights, ``N(0, 0.02 /
    sqrt(2 n_layer))`` for the residual projections ``*.proj.weight`` (their
    2 n_layer contributions add up in the residual stream), biases 0, LayerNorm
    weights 1. Draws happen in sorted-name order, so a name's values depend on
    the config and the seed only.

    Args:
      config: the shapes.
      seed: seed of ``numpy.random.default_rng``.

    Returns:
      {name: float64 array}, names in registration order (`state_dict_shapes`).
    """
    rng = np.random.default_rng(seed)
    shapes = state_dict_shapes(config)
    values: dict[str, np.ndarray] = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith(".bias"):
            values[name] = np.zeros(shape)
        elif name.startswith("ln") or ".ln_" in name:
            values[name] = np.ones(shape)
        elif name.endswith("proj.weight"):
            values[name] = rng.normal(0.0, 0.02 / math.sqrt(2 * config.n_layer), shape)
        else:
            values[name] = rng.normal(0.0, 0.02, shape)
    return {name: values[name] for name in shapes}


def flax_path(name: str) -> tuple[FlaxPath, bool]:
    """Where a torch name lives in the Flax params, and whether its array is transposed.

    Example:
      >>> flax_path("h.0.attn.qkv.weight")
      (('h', 0, 'attn', 'qkv', 'kernel'), True)
    """
    *modules, leaf = name.split(".")
    path: FlaxPath = tuple(int(p) if p.isdigit() else p for p in modules)
    if modules[-1] in ("wte", "wpe"):
        return (*path, "embedding"), False
    if modules[-1].startswith("ln"):
        return (*path, "scale" if leaf == "weight" else "bias"), False
    return (*path, "kernel" if leaf == "weight" else "bias"), leaf == "weight"


def to_flax_layout(weights: dict[str, Any], config: TinyGPTConfig, dtype: Any = None) -> dict:
    """Torch-layout state dict -> the Flax model's nested params dict (numpy arrays).

    Args:
      weights: {name: array}, torch layout (checked by `check_state_dict`).
      config: the model the weights are for.
      dtype: cast every array to this dtype (None: keep each array's dtype).

    Returns:
      ``params["h"][0]["attn"]["qkv"]["kernel"]`` and so on, Linear kernels [in, out].

    Raises:
      ValueError: see `check_state_dict`.
    """
    check_state_dict(weights, config)
    params: dict = {}
    for name in state_dict_shapes(config):
        path, transpose = flax_path(name)
        array = np.asarray(weights[name])
        array = array.T if transpose else array
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = array if dtype is None else array.astype(dtype)
    return params


def to_torch_layout(params: dict, config: TinyGPTConfig) -> dict[str, np.ndarray]:
    """The inverse of `to_flax_layout`: nested Flax params -> torch-layout state dict.

    Args:
      params: the nested dict (any array type numpy can read).
      config: the model the params are for.

    Returns:
      {name: numpy array}, names in registration order, dtypes kept.
    """
    weights = {}
    for name in state_dict_shapes(config):
        path, transpose = flax_path(name)
        node = params
        for key in path:
            node = node[key]
        array = np.asarray(node)
        weights[name] = array.T if transpose else array
    return weights
