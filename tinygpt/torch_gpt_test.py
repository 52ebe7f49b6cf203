"""The torch TinyGPT against its spec: an independent numpy forward, the layout, causality."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tinygpt import TinyGPTConfig
from tinygpt.weights import state_dict_shapes

torch = pytest.importorskip("torch", reason="needs torch: no CPU build for this Python here")
torch_gpt = pytest.importorskip(
    "tinygpt.torch_gpt", reason="needs torch: no CPU build for this Python here"
)
F = torch.nn.functional
TinyGPT = torch_gpt.TinyGPT
export_state_dict, load_state_dict_numpy = (
    torch_gpt.export_state_dict,
    torch_gpt.load_state_dict_numpy,
)

CFG = TinyGPTConfig(block_size=16)


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf)(x)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)  # biased variance
    return (x - mu) / np.sqrt(var + eps) * w + b


def numpy_forward(
    weights: dict[str, np.ndarray], cfg: TinyGPTConfig, ids: np.ndarray
) -> np.ndarray:
    """The spec of `tinygpt`'s docstring, written again in float64 numpy, one head at a time."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    t = ids.shape[1]
    d, hd = cfg.d_model, cfg.head_dim
    x = w["wte.weight"][ids] + w["wpe.weight"][:t]
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        h = _layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], cfg.layer_norm_eps)
        qkv = h @ w[p + "attn.qkv.weight"].T + w[p + "attn.qkv.bias"]
        q, k, v = qkv[..., :d], qkv[..., d : 2 * d], qkv[..., 2 * d :]
        heads = []
        for j in range(cfg.n_head):
            sl = slice(j * hd, (j + 1) * hd)
            s = q[..., sl] @ np.swapaxes(k[..., sl], 1, 2) / math.sqrt(hd)
            s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)
            heads.append(a @ v[..., sl])
        att = np.concatenate(heads, -1)
        x = x + att @ w[p + "attn.proj.weight"].T + w[p + "attn.proj.bias"]
        h = _layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], cfg.layer_norm_eps)
        f = h @ w[p + "mlp.fc.weight"].T + w[p + "mlp.fc.bias"]
        f = 0.5 * f * (1.0 + _erf(f / math.sqrt(2.0)))
        x = x + f @ w[p + "mlp.proj.weight"].T + w[p + "mlp.proj.bias"]
    x = _layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], cfg.layer_norm_eps)
    return x @ w["lm_head.weight"].T


def _random_weights(cfg: TinyGPTConfig, seed: int) -> dict[str, np.ndarray]:
    """Every parameter random (biases and LayerNorms too), so all of them matter."""
    rng = np.random.default_rng(seed)
    return {
        k: rng.normal(0.0, 0.2, s).astype(np.float32) for k, s in state_dict_shapes(cfg).items()
    }


def test_forward_matches_an_independent_numpy_implementation_of_the_spec():
    weights = _random_weights(CFG, 1)
    model = TinyGPT(CFG)
    load_state_dict_numpy(model, weights)
    ids = np.random.default_rng(2).integers(0, CFG.vocab_size, (3, CFG.block_size))
    got = model(torch.from_numpy(ids)).detach().numpy()
    # float32 torch vs float64 numpy through 2 blocks: measured 6e-7 on logits of
    # size ~1.4; 1e-5 leaves float32 headroom (a q/k swap in one layer gives 6e-2).
    assert np.abs(got - numpy_forward(weights, CFG, ids)).max() <= 1e-5


def test_state_dict_is_the_documented_layout():
    got = export_state_dict(TinyGPT(CFG))
    # names, order and shapes are weights.state_dict_shapes; float32 by default
    assert [(k, a.shape) for k, a in got.items()] == list(state_dict_shapes(CFG).items())
    assert sum(a.dtype == np.float32 for a in got.values()) == len(got)


def test_export_load_round_trip_is_exact():
    src, dst = TinyGPT(CFG, seed=3), TinyGPT(CFG, seed=4)
    load_state_dict_numpy(dst, export_state_dict(src))
    a, b = export_state_dict(src), export_state_dict(dst)
    assert max(np.abs(a[k] - b[k]).max() for k in a) == 0.0  # a float32 copy is exact
    wide = TinyGPT(CFG, seed=3).double()
    assert export_state_dict(wide, np.float64)["wte.weight"].dtype == np.float64
    # the seed-3 init cast to float32 and back to float64: the float32 values exactly
    assert np.abs(export_state_dict(wide, np.float64)["wte.weight"] - a["wte.weight"]).max() == 0.0


def test_causal_and_padding_harmless():
    model = TinyGPT(CFG, seed=0)
    rng = np.random.default_rng(5)
    ids = torch.from_numpy(rng.integers(0, 256, (2, 16)))
    other = ids.clone()
    other[:, 10:] = torch.from_numpy(rng.integers(0, 256, (2, 6)))  # change the future only
    la, lb = model(ids), model(other)
    # Masked scores are exp(-inf) = 0 exactly; earlier rows see identical inputs.
    assert (la[:, :10] - lb[:, :10]).abs().max().item() <= 1e-6
    # Right padding: the loss over the valid prefix is the same with or without it.
    labels = ids[:, 1:10]
    short = F.cross_entropy(model(ids[:, :10])[:, :9].reshape(-1, 256), labels.reshape(-1))
    long = F.cross_entropy(model(other)[:, :9].reshape(-1, 256), labels.reshape(-1))
    assert abs(short.item() - long.item()) <= 1e-6 * short.item()  # float32 summation order


def test_bad_inputs_raise_clear_errors():
    model = TinyGPT(CFG)
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids: expected \[B, T\]"):
        model(torch.zeros(17, dtype=torch.long))
    with pytest.raises(ValueError, match="d_model=10 must be divisible by n_head=4"):
        TinyGPTConfig(d_model=10)
