"""The torch tests' toolkit: skewed-length data, micro-batches, window gradients.

`skewed_batch` builds a global batch whose samples hold very different numbers
of valid (shifted) labels, with masked prompts, right padding, and samples with
no label at all, so that every wrong normalization shows up (the project's one
generator, ``tinygpt.data.skewed_batch``; `microbatches` cuts it with
``tinygpt.data.split_rows(..., deal="in_order")``). With the default lengths and 8 samples:

    valid labels per sample   2, 47, 0, 0, 30, 1, 20, 40      (N = 140)
    layout (world 4, k 1)     ranks hold 49, 0, 31, 60        (one rank empty)
    layout (world 2, k 2)     ranks hold 49, 91; rank 0's 2nd micro-batch is empty
    layout (world 1, k 4)     micro-batches hold 49, 0, 31, 60

`window_grad` reads the gradient the optimizer saw after one `train_update`
with ``SGD(lr=0)`` (the step leaves the parameters unchanged, ``p.grad`` holds
the window gradient); deviations are relative L2 over all parameters,
``||g - g_ref|| / ||g_ref||`` (`rel_l2`). `tiny_gpt2` is the Hugging Face model of
the HF Trainer audits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tinygpt import TinyGPTConfig, data
from tinygpt.torch_gpt import TinyGPT
from torch_ref import train_update

CONFIG = TinyGPTConfig(block_size=48)  # the tests' model; skewed_batch's default seq_len is 48
# Same-data different-layout window gradients agree to ~1e-7 relative (float32
# summation order, measured 1.2e-7); 1e-5 is 80x that and 4+ orders of magnitude below any bug.
LAYOUT_RTOL = 1e-5
SKEWED_VALID: tuple[int, ...] = (2, 47, 0, 0, 30, 1, 20, 40)


def skewed_batch(
    seed: int,
    valid: tuple[int, ...] = SKEWED_VALID,
    seq_len: int = 48,
    vocab_size: int = 256,
) -> tuple[np.ndarray, np.ndarray]:
    """``tinygpt.data.skewed_batch`` with the torch tests' settings: the given valid-label
    counts, a prompt of ``min(4, seq_len - valid[i])`` tokens (position 0 and up to 3
    more, label -100), ids from ``[1, vocab_size)``, int64 ``[len(valid), seq_len]``."""
    return data.skewed_batch(
        seed, valid, seq_len=seq_len, prompt_len=4, vocab=vocab_size, dtype=np.int64
    )


def microbatches(
    input_ids: np.ndarray, labels: np.ndarray, k: int
) -> list[dict[str, torch.Tensor]]:
    """One rank's window: the batch cut into k consecutive micro-batches, as tensors."""
    tokens, labels = data.split_rows(input_ids, labels, 1, k, deal="in_order")  # [1, k, mb, T]
    return [
        {
            "input_ids": torch.from_numpy(t.astype(np.int64)),
            "labels": torch.from_numpy(y.astype(np.int64)),
        }
        for t, y in zip(tokens[0], labels[0], strict=True)
    ]


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient, concatenated in parameter order."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||``."""
    return float((a - b).norm() / b.norm())


def window_grad(
    window: list[dict[str, torch.Tensor]], *, seed: int = 0, **train_update_kwargs: Any
) -> tuple[dict[str, Any], torch.Tensor]:
    """(record, window gradient) of one `train_update` of ``TinyGPT(CONFIG, seed)``, SGD lr 0."""
    model = TinyGPT(CONFIG, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    record = train_update(model, window, opt, **train_update_kwargs)
    return record, flat_grad(model)


def tiny_gpt2(seq_len: int = 12, class_name: str = "GPT2LMHeadModel") -> Any:
    """A randomly initialized GPT-2 of 4k parameters, without dropout (no download), as an
    instance of a ``GPT2LMHeadModel`` subclass called ``class_name``."""
    import transformers  # the hf extra: only the HF Trainer's tests and stress need it

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=seq_len, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model_class = transformers.GPT2LMHeadModel
    if class_name != model_class.__name__:
        model_class = type(class_name, (model_class,), {})
    return model_class(config)
