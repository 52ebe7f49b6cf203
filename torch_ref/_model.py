"""TinyGPT: the small causal transformer shared by torch_ref and its Flax twin.

This file is the FIXED SPEC of the model. A Flax twin elsewhere in the project
is written from this docstring; parity tests load the same numpy weights into
both and compare logits, losses and updates. Change nothing here without
changing the twin.

Config (`TinyGPTConfig`)::

    vocab_size=256      byte-level vocabulary
    block_size=128      maximum sequence length T (size of the position table)
    n_layer=2           number of transformer blocks
    n_head=4            attention heads; head_dim = d_model // n_head
    d_model=64          residual width d; MLP hidden width is 4 * d
    layer_norm_eps=1e-5

Forward: ``input_ids`` [B, T] int64 (T <= block_size) -> logits [B, T, vocab]::

    x = wte[input_ids] + wpe[0:T]
    for each block i:                               # pre-LN
        x = x + attn_i(ln_1_i(x))
        x = x + mlp_i(ln_2_i(x))
    logits = lm_head(ln_f(x))

    attn(h):  qkv = h @ W_qkv^T + b_qkv             # [B, T, 3d]
              q, k, v = split(qkv, 3, last axis)     # in this order, each [B, T, d]
              q, k, v -> [B, T, n_head, head_dim]    # plain reshape of the last axis
              s = q k^T / sqrt(head_dim)             # per head, [B, n_head, T, T]
              s[t, u] = -inf where u > t             # causal mask
              a = softmax(s, last axis) v            # [B, n_head, T, head_dim]
              heads concatenated back to [B, T, d] (head-major: head 0 first)
              out = a @ W_proj^T + b_proj
    mlp(h):   proj(GELU(fc(h))), GELU exact: 0.5 x (1 + erf(x / sqrt(2)))
    LayerNorm: biased variance over the last axis, eps = layer_norm_eps

No dropout, no attention mask: sequences are right-padded and padded positions
carry label -100; with causal attention, padding never influences a valid
position, so it is harmless.

Parameters (state_dict names, torch layout: nn.Linear weights are [out, in],
``y = x @ W^T + b``)::

    wte.weight                 [vocab_size, d]      token embedding
    wpe.weight                 [block_size, d]      position embedding
    h.{i}.ln_1.weight/bias     [d]
    h.{i}.attn.qkv.weight      [3d, d]   .bias [3d]   rows 0:d -> q, d:2d -> k, 2d:3d -> v
    h.{i}.attn.proj.weight     [d, d]    .bias [d]
    h.{i}.ln_2.weight/bias     [d]
    h.{i}.mlp.fc.weight        [4d, d]   .bias [4d]
    h.{i}.mlp.proj.weight      [d, 4d]   .bias [d]
    ln_f.weight/bias           [d]
    lm_head.weight             [vocab_size, d]      no bias, not tied to wte

A Flax ``nn.Dense`` kernel is the transpose of the torch weight ([in, out]).

Init (``TinyGPT(config, seed=0)``, deterministic on CPU): every nn.Linear and
nn.Embedding weight ~ Normal(0, 0.02) drawn in module registration order from
``torch.Generator().manual_seed(seed)``, every bias 0, LayerNorm weight 1 and
bias 0. The twin does not reproduce torch's RNG: parity goes through
`export_state_dict` / `load_state_dict_numpy`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class TinyGPTConfig:
    """Shape of a `TinyGPT`. All fields are plain ints/floats (see module doc).

    Attributes:
      vocab_size: number of token ids (256: bytes).
      block_size: maximum sequence length T; size of the position table.
      n_layer: number of pre-LN transformer blocks.
      n_head: number of attention heads; must divide d_model.
      d_model: residual width d; the MLP hidden width is 4 * d.
      layer_norm_eps: epsilon of every LayerNorm.
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"TinyGPTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head}"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: softmax(q k^T / sqrt(hd), causal) v."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head
        self.head_dim = d // config.n_head
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, T, d]."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # [B, T, d] -> [B, n_head, T, head_dim]
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        att = torch.softmax(scores, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)  # heads concatenated
        return self.proj(y)


class MLP(nn.Module):
    """proj(GELU_exact(fc(x))), hidden width 4 * d."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU(approximate="none")
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, T, d]."""
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LN block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        d, eps = config.d_model, config.layer_norm_eps
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> [B, T, d]."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Small causal transformer; see the module docstring for the exact spec.

    Args:
      config: the shapes; defaults give ~0.14M parameters.
      seed: seed of the deterministic Normal(0, 0.02) init.

    Example:
      >>> model = TinyGPT(TinyGPTConfig(), seed=0)
      >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
      torch.Size([2, 5, 256])
    """

    def __init__(self, config: TinyGPTConfig = TinyGPTConfig(), seed: int = 0) -> None:
        super().__init__()
        self.config = config
        d = config.d_model
        self.wte = nn.Embedding(config.vocab_size, d)
        self.wpe = nn.Embedding(config.block_size, d)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for module in self.modules():  # registration order
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02, generator=gen)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits for every position.

        Args:
          input_ids: [B, T] int64 token ids, T <= block_size.

        Returns:
          [B, T, vocab_size] logits (float32, or the autocast dtype).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, T], got shape {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.config.block_size:
            raise ValueError(
                f"input_ids: sequence length {t} exceeds block_size={self.config.block_size}"
            )
        pos = torch.arange(t, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def export_state_dict(model: nn.Module, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Numpy copies (float32 by default) of every parameter, torch names and layout.

    Args:
      model: a TinyGPT, possibly wrapped in DistributedDataParallel.
      dtype: np.float32 (default) or np.float64 (e.g. for a float64 model).

    Returns:
      {name: array}, names and shapes as in the module docstring
      (Linear weights [out, in]).
    """
    torch_dtype = {"float32": torch.float32, "float64": torch.float64}[np.dtype(dtype).name]
    return {
        name: t.detach().to("cpu", torch_dtype).numpy().copy()
        for name, t in _unwrap(model).state_dict().items()
    }


def load_state_dict_numpy(model: nn.Module, weights: dict[str, np.ndarray]) -> None:
    """Copies numpy weights (as produced by `export_state_dict`) into ``model``.

    Every name must be present with exactly the expected shape; values are cast
    to each parameter's dtype and device.

    Args:
      model: a TinyGPT, possibly wrapped in DistributedDataParallel.
      weights: {name: array} in torch layout.

    Raises:
      ValueError: missing or unexpected names, or a shape mismatch.
    """
    target = _unwrap(model).state_dict()
    missing = sorted(set(target) - set(weights))
    extra = sorted(set(weights) - set(target))
    if missing or extra:
        raise ValueError(f"weights: missing names {missing}, unexpected names {extra}")
    with torch.no_grad():
        for name, t in target.items():
            arr = np.asarray(weights[name])
            if tuple(arr.shape) != tuple(t.shape):
                raise ValueError(
                    f"weights[{name!r}]: expected shape {tuple(t.shape)}, got {tuple(arr.shape)}"
                )
            t.copy_(torch.from_numpy(np.array(arr, copy=True)).to(t.dtype))
