"""The numpy side of the pair: the init's statistics, the Flax layout, the loader's errors."""

from __future__ import annotations

import ast
import math
import subprocess
import sys

import numpy as np
import pytest

from tinygpt import TinyGPTConfig
from tinygpt.weights import (
    check_state_dict,
    init_state_dict,
    state_dict_shapes,
    to_flax_layout,
    to_torch_layout,
)

CFG = TinyGPTConfig()


def test_init_is_deterministic_and_gpt2_style():
    a, b, c = init_state_dict(CFG, 0), init_state_dict(CFG, 0), init_state_dict(CFG, 1)
    # Same seed, same generator, same draw order: bitwise identical.
    assert max(np.abs(a[k] - b[k]).max() for k in a) == 0.0
    assert np.abs(a["wte.weight"] - c["wte.weight"]).max() > 0.01  # another seed, other draws
    fc = a["h.0.mlp.fc.weight"]  # 16384 draws: std within 3% of 0.02 (sampling error ~0.6%)
    assert abs(fc.std() - 0.02) < 0.02 * 0.03
    assert abs(fc.mean()) < 0.002  # sampling error of the mean ~1.6e-4
    proj = a["h.1.mlp.proj.weight"]  # residual projection: 0.02 / sqrt(2 n_layer) = 0.01
    assert abs(proj.std() - 0.02 / math.sqrt(2 * CFG.n_layer)) < 0.01 * 0.03
    assert np.abs(a["h.1.attn.qkv.bias"]).max() == 0.0  # biases are exactly 0
    assert np.abs(a["ln_f.weight"] - 1.0).max() == 0.0  # LayerNorm weight exactly 1
    assert [(k, v.shape) for k, v in a.items()] == list(state_dict_shapes(CFG).items())


def test_flax_layout_transposes_the_kernels_and_round_trips():
    weights = init_state_dict(CFG, 0)
    params = to_flax_layout(weights, CFG)
    kernel = params["h"][1]["attn"]["qkv"]["kernel"]
    assert kernel.shape == (64, 192)  # torch [3d, d] transposed
    assert np.abs(kernel - weights["h.1.attn.qkv.weight"].T).max() == 0.0  # a view: exact
    back = to_torch_layout(params, CFG)
    assert list(back) == list(weights)
    # a transpose and back: bit-exact, tolerance 0
    assert max(float(np.abs(back[n] - weights[n]).max()) for n in weights) == 0.0
    cast = to_flax_layout(weights, CFG, dtype=np.float32)
    assert cast["wte"]["embedding"].dtype == np.float32


def test_loader_names_the_bad_entry():
    weights = init_state_dict(CFG, 0)
    missing = dict(weights)
    del missing["h.0.mlp.fc.bias"]
    with pytest.raises(ValueError, match=r"missing names \['h.0.mlp.fc.bias'\]"):
        check_state_dict(missing, CFG)
    with pytest.raises(ValueError, match=r"unexpected names \['extra'\]"):
        to_flax_layout(dict(weights, extra=np.zeros(3)), CFG)
    wrong = dict(weights, **{"h.1.attn.proj.weight": np.zeros((64, 63))})
    with pytest.raises(ValueError, match=r"weights\['h\.1\.attn\.proj\.weight'\]: expected shape"):
        to_flax_layout(wrong, CFG)


def test_the_numpy_side_imports_neither_framework():
    """``tinygpt`` and ``tinygpt.weights`` serve both models: numpy only, in a fresh interpreter."""
    code = "import sys, tinygpt.weights; print(sorted({m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    loaded = set(ast.literal_eval(out.stdout))
    assert loaded & {"torch", "jax", "flax", "optax"} == set()  # 0 framework modules
