"""Skewed-length test data, shared by torch_ref's tests (and usable by others).

`skewed_batch` builds a global batch whose samples hold very different numbers
of valid (shifted) labels, with masked prompts, right padding, and samples with
no label at all, so that every wrong normalization shows up. With the default
lengths and 8 samples:

    valid labels per sample   2, 47, 0, 0, 30, 1, 20, 40      (N = 140)
    layout (world 4, k 1)     ranks hold 49, 0, 31, 60        (one rank empty)
    layout (world 2, k 2)     ranks hold 49, 91; rank 0's 2nd micro-batch is empty
    layout (world 1, k 4)     micro-batches hold 49, 0, 31, 60
"""

from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100
SKEWED_VALID: tuple[int, ...] = (2, 47, 0, 0, 30, 1, 20, 40)


def skewed_batch(
    seed: int,
    valid: tuple[int, ...] = SKEWED_VALID,
    seq_len: int = 48,
    vocab_size: int = 256,
) -> tuple[np.ndarray, np.ndarray]:
    """A global batch of right-padded sequences with the given valid-label counts.

    Sample i: a prompt of ``p_i = min(3, seq_len - 1 - valid[i])`` tokens whose
    labels are -100, then ``valid[i]`` labelled tokens, then padding (token 0,
    label -100). Labels are aligned with the inputs (``labels[t] = ids[t]``);
    the causal shift happens in the loss, so label position 0 is never a target.

    Args:
      seed: numpy seed of the token ids.
      valid: valid (shifted) labels per sample, each <= seq_len - 1.
      seq_len: T.
      vocab_size: ids are drawn from [1, vocab_size).

    Returns:
      (input_ids, labels), both int64 [len(valid), seq_len].
    """
    rng = np.random.default_rng(seed)
    n = len(valid)
    ids = rng.integers(1, vocab_size, (n, seq_len)).astype(np.int64)
    labels = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int64)
    for i, v in enumerate(valid):
        if not 0 <= v <= seq_len - 1:
            raise ValueError(f"valid[{i}]={v}: expected 0 <= v <= seq_len - 1 = {seq_len - 1}")
        p = min(3, seq_len - 1 - v)
        end = 1 + p + v
        labels[i, 1 + p : end] = ids[i, 1 + p : end]
        ids[i, end:] = 0
    return ids, labels
