"""TinyGPT in PyTorch, the twin of `tinygpt.flax_gpt` (the model is in `tinygpt`'s docstring).

Read it beside ``flax_gpt.py``: the same classes, attributes and order. What
differs is the framework's idiom: ``forward`` for ``__call__``; ``nn.Linear``
weights [out, in] (Flax kernels are the transpose, `tinygpt.weights` maps
them); mixed precision through ``torch.autocast`` and ``.to(dtype)`` instead of
dtype arguments; torch's own ``nn.LayerNorm`` (the same two-pass biased
variance).

Example:
    >>> model = TinyGPT(TinyGPTConfig(block_size=16), seed=0)
    >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
    torch.Size([2, 5, 256])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from tinygpt import TinyGPTConfig
from tinygpt.weights import check_state_dict, init_state_dict

__all__ = [
    "MLP",
    "Block",
    "CausalSelfAttention",
    "TinyGPT",
    "TinyGPTConfig",
    "export_state_dict",
    "load_state_dict_numpy",
]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``softmax(q k^T / sqrt(head_dim) + causal) v``."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, T, d]."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)  # q, k, v in this order
        # [B, T, d] -> [B, n_head, T, head_dim]
        q, k, v = (a.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for a in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        att = torch.softmax(scores, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)  # heads concatenated
        return self.proj(y)


class MLP(nn.Module):
    """``proj(GELU(fc(x)))`` with the exact (erf) GELU, hidden width 4 d."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, T, d]."""
        return self.proj(F.gelu(self.fc(x), approximate="none"))


def _layer_norm(config: TinyGPTConfig) -> nn.LayerNorm:
    """LayerNorm over d: ``(x - mean) / sqrt(biased var + eps) * weight + bias``."""
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)


class Block(nn.Module):
    """Pre-LN block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.ln_1 = _layer_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = _layer_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, T, d]."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """The small causal transformer of `tinygpt` (float32 parameters; ``.double()`` for float64).

    Args:
      config: the shapes (the defaults: ~0.14M parameters).
      seed: the initial weights are ``weights.init_state_dict(config, seed)``.
    """

    def __init__(self, config: TinyGPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.wte = nn.Embedding(config.vocab_size, d)
        self.wpe = nn.Embedding(config.block_size, d)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = _layer_norm(config)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self._init_weights(seed)

    def _init_weights(self, seed: int) -> None:
        """Loads the GPT-2 style numpy init (the Flax twin loads the same numbers)."""
        load_state_dict_numpy(self, init_state_dict(self.config, seed))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] int64 token ids -> [B, T, vocab_size] logits (parameter or autocast dtype)."""
        self.config.check_input_shape(tuple(input_ids.shape))
        t = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(torch.arange(t, device=input_ids.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def export_state_dict(model: TinyGPT, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """``model.state_dict()`` as numpy copies: the torch names and layout of `tinygpt.weights`.

    Args:
      model: a torch TinyGPT, on any device, in any parameter dtype.
      dtype: of the copies, np.float32 (default) or np.float64.

    Returns:
      {name: array}, in the module's registration order.
    """
    torch_dtype = {"float32": torch.float32, "float64": torch.float64}[np.dtype(dtype).name]
    return {
        name: t.detach().to("cpu", torch_dtype).numpy().copy()
        for name, t in model.state_dict().items()
    }


def load_state_dict_numpy(model: TinyGPT, weights: dict[str, Any]) -> None:
    """Copies torch-layout numpy weights into ``model``'s tensors (their dtype and device).

    Args:
      model: a torch TinyGPT.
      weights: {name: array} with the names and shapes of ``weights.state_dict_shapes``.

    Raises:
      ValueError: from ``weights.check_state_dict``, before any tensor changes.
    """
    check_state_dict(weights, model.config)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(torch.from_numpy(np.array(weights[name], copy=True)).to(t.dtype))
