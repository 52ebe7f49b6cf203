"""The rows and the model fed to TRL's GRPOTrainer: fixed completions and rewards, a tiny GPT-2.

Nothing is generated or downloaded: a word-level tokenizer built in memory
(`WORDS`), a GPT-2 of one layer from a config, and `COMPLETION_LENGTHS`
completions handed in by ``rollout_func`` with fixed rewards.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from torch_ref._audit_trl_cut import NUM_GENERATIONS

COMPLETION_LENGTHS = (
    (1, 2, 2, 3), (2, 4, 3, 5), (5, 7, 6, 8), (8, 6, 7, 4),
    (3, 1, 2, 2), (6, 8, 7, 5), (1, 2, 2, 3), (2, 3, 1, 2),
)  # fmt: skip
"""The completions' tokens, ``[prompt][generation]``: prompts 0-3 fill a window (the rows of
every cut with ``steps_per_generation = GA``), 4-7 the next one of a generation of two windows.
Micro-batches of every cut differ in tokens, so do the two windows of a generation, and no
group has two completions of one token (their entropy terms would be the same vector)."""
SEED = 0
WEIGHT_SCALE = 20.0
"""The model's weight matrices are GPT-2's initialization times this: gradients well above
the rounding of the update read back as ``new - old``."""
WORDS = ["[PAD]", "[EOS]", "[UNK]", "q"] + [f"p{p}" for p in range(len(COMPLETION_LENGTHS))]
WORDS += [f"c{i}" for i in range(len(COMPLETION_LENGTHS) * NUM_GENERATIONS)]


def word_tokenizer() -> Any:
    """A word-level tokenizer built in memory (no download): `WORDS`, split at spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )


def tiny_gpt2() -> nn.Module:
    """A GPT-2 of 1 layer, width 16, random weights (seeded; the global RNG is left alone)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    pad, eos = WORDS.index("[PAD]"), WORDS.index("[EOS]")
    config = GPT2Config(
        vocab_size=len(WORDS), n_positions=32, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=eos, eos_token_id=eos,
        pad_token_id=pad,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(WEIGHT_SCALE)
    return model


def rollouts() -> dict[str, list]:
    """Every prompt's completions (token ids, `COMPLETION_LENGTHS` long, all different: the
    first token is the row's own) and rewards, row ``p G + j`` for generation ``j`` of ``p``."""
    rng = np.random.default_rng(SEED)
    words = [WORDS.index(f"c{i}") for i in range(len(COMPLETION_LENGTHS) * NUM_GENERATIONS)]
    completions, rewards = [], []
    for lengths in COMPLETION_LENGTHS:
        rewards += rng.permutation([0.0, 1.0, 2.0, 4.0]).tolist()
        for n in lengths:
            completions.append([words[len(completions)], *rng.choice(words, n - 1).tolist()])
    return {"completions": completions, "rewards": rewards}
