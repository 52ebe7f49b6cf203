"""TinyGPT, twice: one small causal transformer in PyTorch and in Flax NNX, side by side.

The project trains the same model in two frameworks and compares the numbers
(``parity_tests``), so the model is written twice, as a pair that a reader can
diff (minGPT's way: load the same weights into two implementations, compare)::

    tinygpt/__init__.py    TinyGPTConfig: the shapes, one plain dataclass both take
    tinygpt/weights.py     numpy only: the state-dict names and layout, the GPT-2
                           style initial weights, the torch <-> Flax mapping
    tinygpt/torch_gpt.py   TinyGPT as a torch.nn.Module   (torch_ref trains it)
    tinygpt/flax_gpt.py    TinyGPT as a flax.nnx.Module   (run by jaxaccum's users)

Both files hold the same classes (``CausalSelfAttention``, ``MLP``, ``Block``,
``TinyGPT``) with the same attributes in the same order, then the same two
functions (``export_state_dict``, ``load_state_dict_numpy``). ``TinyGPT(config,
seed)`` is the same function in both: each builds its layers, then loads
``weights.init_state_dict(config, seed)`` (numpy) into them. Neither framework's
own random initializer decides a number.

The model (pre-LN, GPT-2 shaped; ``input_ids`` [B, T] int, T <= block_size)::

    x = wte[input_ids] + wpe[0:T]
    for each block i:
        x = x + attn_i(ln_1_i(x))
        x = x + mlp_i(ln_2_i(x))
    logits = lm_head(ln_f(x))                          # [B, T, vocab_size]

    attn(h):  q, k, v = split(qkv(h), 3, last axis)     # in this order, each [B, T, d]
              per head: a = softmax(q k^T / sqrt(head_dim) + causal mask) v
              heads concatenated (head 0 first), then proj
    mlp(h):   proj(GELU(fc(h))), GELU exact: 0.5 x (1 + erf(x / sqrt(2)))
    LayerNorm: biased (two-pass) variance over the last axis, eps = layer_norm_eps

No dropout and no attention mask: sequences are right padded, padded positions
carry label -100, and causal attention keeps the padding out of every valid
position. ``lm_head`` has no bias and is not tied to ``wte``.

Importing ``tinygpt`` imports neither torch nor jax: import ``tinygpt.torch_gpt``
or ``tinygpt.flax_gpt`` for the framework at hand (``torch_ref`` re-exports the
torch one and never imports jax; ``jaxaccum`` never imports torch).
"""

from __future__ import annotations

import dataclasses

__all__ = ["TinyGPTConfig"]


@dataclasses.dataclass(frozen=True)
class TinyGPTConfig:
    """The shapes of a TinyGPT, plain ints and a float (the defaults: ~0.14M parameters).

    Attributes:
      vocab_size: number of token ids (256: bytes).
      block_size: maximum sequence length T; rows of the position table.
      n_layer: number of pre-LN transformer blocks.
      n_head: attention heads; must divide ``d_model``.
      d_model: residual width d; the MLP's hidden width is 4 d.
      layer_norm_eps: epsilon of every LayerNorm.

    Raises:
      ValueError: ``d_model`` is not a multiple of ``n_head``.

    Example:
      >>> TinyGPTConfig(block_size=32).head_dim
      16
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

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``d_model // n_head``."""
        return self.d_model // self.n_head

    def check_input_shape(self, shape: tuple[int, ...]) -> None:
        """Checks that ``input_ids`` of this ``shape`` fit the model: [B, T], T <= block_size.

        Raises:
          ValueError: naming ``input_ids`` and what was expected.
        """
        if len(shape) != 2:
            raise ValueError(f"input_ids: expected [B, T], got shape {tuple(shape)}")
        if shape[1] > self.block_size:
            raise ValueError(
                f"input_ids: sequence length {shape[1]} exceeds block_size={self.block_size}"
            )
