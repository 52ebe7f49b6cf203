"""The Flax TinyGPT: the module and the pure function agree, causality, export and load."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tinygpt import TinyGPTConfig
from tinygpt.flax_gpt import (
    TinyGPT,
    apply,
    export_state_dict,
    load_state_dict_numpy,
    params_from_state_dict,
)
from tinygpt.weights import init_state_dict

CFG = TinyGPTConfig()


def _input_ids(batch: int = 2, length: int = 128, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, (batch, length)).astype(np.int32)


def _rel(a, b) -> float:
    """max |a - b| / max |b|."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.slow  # compiles a model or a multi-device program (> 1 s): make test, not test-fast
def test_module_equals_the_pure_function():
    model = TinyGPT(CFG, seed=0)
    ids = _input_ids()
    logits = nnx.jit(lambda m, x: m(x))(model, ids)
    params = params_from_state_dict(init_state_dict(CFG, 0), CFG, dtype=jnp.float32)
    # the same traced computation: identical up to XLA's choices between two compilations
    assert _rel(logits, apply(params, ids, CFG)) < 1e-6


def test_a_prefix_does_not_see_what_follows():
    """Causal attention: a prefix's logits do not depend on the rest (e.g. the padding)."""
    params = params_from_state_dict(init_state_dict(CFG, 0), CFG, dtype=jnp.float32)
    ids = _input_ids(seed=2)
    full, prefix = apply(params, ids, CFG), apply(params, ids[:, :7], CFG)
    # fp32: the same computation on fewer positions (matmul blocking may differ): ~1e-7.
    assert _rel(prefix, np.asarray(full)[:, :7]) < 1e-5


def test_export_load_round_trip_is_exact():
    cfg = TinyGPTConfig(block_size=16)
    src, dst = TinyGPT(cfg, seed=3), TinyGPT(cfg, seed=4)
    load_state_dict_numpy(dst, export_state_dict(src))
    a, b = export_state_dict(src), export_state_dict(dst)
    assert list(a) == list(init_state_dict(cfg, 3))  # torch names, registration order
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) == 0.0  # a float32 copy is exact
    assert dst.h[1].attn.qkv.kernel.shape == (64, 192)  # Flax [in, out]


def test_bad_inputs_raise_clear_errors():
    params = params_from_state_dict(init_state_dict(CFG, 0), CFG, dtype=jnp.float32)
    with pytest.raises(ValueError, match="exceeds block_size=128"):
        apply(params, np.zeros((1, 129), np.int32), CFG)
    # a 128-row position table into a block_size=16 model: named, with both shapes
    with pytest.raises(ValueError, match=r"weights\['wpe.weight'\]: expected shape \(16, 64\)"):
        load_state_dict_numpy(TinyGPT(TinyGPTConfig(block_size=16)), init_state_dict(CFG, 0))
