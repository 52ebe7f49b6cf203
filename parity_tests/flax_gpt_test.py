"""The Flax twin computes what ``torch_ref.TinyGPT`` computes, weight for weight (minGPT-style)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import torch_ref
from parity_tests import flax_gpt


@pytest.fixture(scope="module")
def weights():
    return flax_gpt.init_state_dict(seed=0)


def _tokens(batch=2, length=128, seed=1):
    return np.random.default_rng(seed).integers(0, 256, (batch, length)).astype(np.int32)


def _torch_logits(weights, tokens, dtype=torch.float32, autocast=None):
    model = torch_ref.TinyGPT(torch_ref.TinyGPTConfig()).to(dtype)
    torch_ref.load_state_dict_numpy(model, weights)
    with torch.no_grad(), torch_ref.one_cpu_thread():
        ids = torch.from_numpy(tokens.astype(np.int64))
        if autocast is None:
            return model(ids).double().numpy()
        with torch.autocast("cpu", dtype=autocast):
            return model(ids).float().double().numpy()


def _rel(a, b):
    """max |a - b| / max |b|."""
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def test_logits_match_torch_fp32(weights):
    tokens = _tokens()
    ref = _torch_logits(weights, tokens)
    ours = np.asarray(
        flax_gpt.apply(flax_gpt.params_from_state_dict(weights, dtype=jnp.float32), tokens)
    )
    # fp32 (unit roundoff 6e-8): each logit is ~5 chained matmuls of 64-256 terms plus two
    # softmax/LayerNorm reductions, summed in different orders by XLA and torch; measured 3.4e-7.
    assert _rel(ours, ref) < 1e-5


def test_logits_match_torch_fp64(weights):
    tokens = _tokens()
    ref = _torch_logits(weights, tokens, dtype=torch.float64)
    with jax.enable_x64(True):
        ours = np.asarray(
            flax_gpt.apply(flax_gpt.params_from_state_dict(weights, dtype=jnp.float64), tokens)
        )
    assert ours.dtype == np.float64
    # fp64 (unit roundoff 1.1e-16): the same sums as above, measured 7.8e-16.
    assert _rel(ours, ref) < 1e-12


def test_logits_match_torch_bf16_compute(weights):
    tokens = _tokens()
    ref = _torch_logits(weights, tokens, autocast=torch.bfloat16)
    ours = np.asarray(
        flax_gpt.apply(
            flax_gpt.params_from_state_dict(weights, dtype=jnp.float32),
            tokens,
            compute_dtype=jnp.bfloat16,
        )
    )
    # bf16 matmuls (8-bit mantissa, roundoff 3.9e-3) on both sides, but torch's CPU autocast and
    # the Flax dtype policy round different intermediates; measured 5.5e-3 of the largest logit.
    assert _rel(ours, ref) < 5e-2


def test_short_and_padded_sequences_match(weights):
    """Causal attention: a prefix's logits do not depend on what follows (the padding)."""
    tokens = _tokens(seed=2)
    params = flax_gpt.params_from_state_dict(weights, dtype=jnp.float32)
    full = np.asarray(flax_gpt.apply(params, tokens))
    prefix = np.asarray(flax_gpt.apply(params, tokens[:, :7]))
    # fp32: the same computation on fewer positions (matmul blocking may differ): ~1e-7.
    assert _rel(prefix, full[:, :7]) < 1e-5
    ref = _torch_logits(weights, tokens[:, :7])
    assert _rel(prefix, ref) < 1e-5


def test_state_dict_round_trip_is_exact(weights):
    params = flax_gpt.params_from_state_dict(weights, to_jax=False)
    assert params["h"][1]["attn"]["qkv"]["kernel"].shape == (64, 192)  # torch [3d, d] transposed
    back = flax_gpt.state_dict_from_params(params)
    assert set(back) == set(weights)
    # a transpose and back: bit-exact, tolerance 0
    assert max(float(np.max(np.abs(back[n] - weights[n]))) for n in weights) == 0.0
    torch_names = set(torch_ref.TinyGPT(torch_ref.TinyGPTConfig()).state_dict())
    assert set(weights) == torch_names


def test_nnx_module_equals_pure_function(weights):
    model = flax_gpt.module_from_state_dict(weights)
    assert isinstance(model, flax_gpt.TinyGPT)
    tokens = _tokens()
    logits = nnx.jit(lambda m, t: m(t))(model, tokens)
    params = flax_gpt.params_from_state_dict(weights, dtype=jnp.float32)
    # the same traced computation: identical up to XLA's choices between two compilations
    assert _rel(logits, np.asarray(flax_gpt.apply(params, tokens), np.float64)) < 1e-6


def test_loader_names_the_bad_entry(weights):
    missing = dict(weights)
    del missing["h.0.mlp.fc.bias"]
    with pytest.raises(KeyError, match="h.0.mlp.fc.bias"):
        flax_gpt.params_from_state_dict(missing)
    wrong = dict(weights, **{"h.1.attn.proj.weight": np.zeros((64, 63))})
    with pytest.raises(ValueError, match=r"h\.1\.attn\.proj\.weight"):
        flax_gpt.params_from_state_dict(wrong)
    with pytest.raises(KeyError, match="extra"):
        flax_gpt.params_from_state_dict(dict(weights, extra=np.zeros(3)))
    with pytest.raises(ValueError, match="block_size"):
        flax_gpt.apply(flax_gpt.params_from_state_dict(weights), np.zeros((1, 129), np.int32))
