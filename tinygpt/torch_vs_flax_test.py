"""minGPT's test: the same weights in the torch and the Flax TinyGPT give the same logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tinygpt import TinyGPTConfig, flax_gpt
from tinygpt.weights import init_state_dict

torch = pytest.importorskip("torch", reason="needs torch: no CPU build for this Python here")
torch_gpt = pytest.importorskip(
    "tinygpt.torch_gpt", reason="needs torch: no CPU build for this Python here"
)

CFG = TinyGPTConfig()


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return init_state_dict(CFG, seed=0)


def _input_ids(batch: int = 2, length: int = 128, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, (batch, length)).astype(np.int32)


def _torch_logits(weights, input_ids, dtype=torch.float32, autocast=None) -> np.ndarray:
    model = torch_gpt.TinyGPT(CFG).to(dtype)
    torch_gpt.load_state_dict_numpy(model, weights)
    ids = torch.from_numpy(input_ids.astype(np.int64))
    with (
        torch.no_grad(),
        torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)),
    ):
        return model(ids).double().numpy()


def _rel(a, b) -> float:
    """max |a - b| / max |b|."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_logits_match_fp32(weights):
    ids = _input_ids()
    ours = flax_gpt.apply(
        flax_gpt.params_from_state_dict(weights, CFG, dtype=jnp.float32), ids, CFG
    )
    # fp32 (unit roundoff 6e-8): each logit is ~5 chained matmuls of 64-256 terms plus two
    # softmax/LayerNorm reductions, summed in different orders by XLA and torch; measured 3.4e-7.
    assert _rel(ours, _torch_logits(weights, ids)) < 1e-5


@pytest.mark.slow  # compiles a model or a multi-device program (> 1 s): make test, not test-fast
def test_logits_match_fp64(weights):
    ids = _input_ids()
    with jax.enable_x64(True):
        ours = np.asarray(
            flax_gpt.apply(
                flax_gpt.params_from_state_dict(weights, CFG, dtype=jnp.float64), ids, CFG
            )
        )
    assert ours.dtype == np.float64
    # fp64 (unit roundoff 1.1e-16): the same sums as above, measured 7.8e-16.
    assert _rel(ours, _torch_logits(weights, ids, dtype=torch.float64)) < 1e-12


@pytest.mark.slow  # compiles a model or a multi-device program (> 1 s): make test, not test-fast
def test_logits_match_bf16_compute(weights):
    ids = _input_ids()
    params = flax_gpt.params_from_state_dict(weights, CFG, dtype=jnp.float32)
    ours = flax_gpt.apply(params, ids, CFG, compute_dtype=jnp.bfloat16)
    # bf16 matmuls (8-bit mantissa, roundoff 3.9e-3) on both sides, but torch's CPU autocast and
    # the Flax dtype policy round different intermediates; measured 5.5e-3 of the largest logit.
    assert _rel(ours, _torch_logits(weights, ids, autocast=torch.bfloat16)) < 5e-2


def test_same_seed_builds_the_same_model_in_both():
    """``TinyGPT(config, seed)`` loads the same numpy init in both frameworks."""
    cfg = TinyGPTConfig(block_size=16)
    a = torch_gpt.export_state_dict(torch_gpt.TinyGPT(cfg, seed=3))
    b = flax_gpt.export_state_dict(flax_gpt.TinyGPT(cfg, seed=3))
    assert list(a) == list(b)  # the same names, in the same (registration) order
    # one float64 -> float32 cast of the same numbers on both sides: bit-exact, tolerance 0
    assert max(float(np.max(np.abs(a[n] - b[n]))) for n in a) == 0.0
