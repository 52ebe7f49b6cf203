"""The one generator and the one layout: skewed as promised, every row exactly once.

Every number here is an integer count or a token id: compared exactly.
"""

import itertools

import numpy as np
import pytest

from bigbatch import IGNORE_INDEX
from tinygpt import data
from tinygpt.data import PAD_TOKEN

LAYOUTS = list(itertools.product((1, 2, 4), (1, 2, 4)))
TORCH_VALID = (2, 47, 0, 0, 30, 1, 20, 40)  # tinygpt.torch_testing's default lengths (N = 140)


def test_corpus_is_real_text():
    text = data.corpus_bytes().decode("ascii")  # byte-level: plain ASCII prose
    assert len(text.splitlines()) >= 300
    words = text.split()
    assert len(words) > 3000 and len(set(words)) > 1000  # prose, not a repeated pattern


def test_default_batch_holds_the_length_mix():
    tokens, labels = data.skewed_batch(0, rows=16, seq_len=128)
    n = data.valid_tokens(labels)
    # per 16 rows: 2 empty, 6 of 2-5 tokens, 2 of 20-40, 6 of 90-110 (exact counts)
    classes = [(0, 0), (2, 5), (20, 40), (90, 110)]
    assert [int(((n >= lo) & (n <= hi)).sum()) for lo, hi in classes] == [2, 6, 2, 6]
    assert np.all(labels[:, 0] == IGNORE_INDEX)  # position 0 is never a target
    valid = labels != IGNORE_INDEX
    assert np.array_equal(labels[valid], tokens[valid])  # a label is its own token
    assert tokens.dtype == labels.dtype == np.int32
    # corpus bytes: printable ASCII or newline wherever a row has text
    text = tokens[tokens != PAD_TOKEN]
    assert ((text == 10) | ((text >= 32) & (text < 127))).all()


def test_batches_from_one_generator_follow_each_other():
    rng = np.random.default_rng(3)
    first, second = data.skewed_batch(rng), data.skewed_batch(rng)
    again = data.skewed_batch(np.random.default_rng(3))
    assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    assert not np.array_equal(first[0], second[0])  # the generator moved on


def test_given_lengths_with_a_fixed_prompt():
    tokens, labels = data.skewed_batch(0, TORCH_VALID, seq_len=48, prompt_len=4, vocab=256,
                                       dtype=np.int64)  # fmt: skip
    assert data.valid_tokens(labels).tolist() == list(TORCH_VALID)  # exact, N = 140
    assert tokens.dtype == np.int64 and tokens.max() < 256
    # prompt of min(4, T - n) tokens (47 valid of 48: a 1-token prompt), then padding
    assert (labels[1, :1] == IGNORE_INDEX).all() and (labels[1, 1:] >= 0).all()
    assert (labels[0, :4] == IGNORE_INDEX).all() and (labels[0, 4:6] >= 1).all()
    assert (tokens[0, 6:] == PAD_TOKEN).all() and (tokens[0, :6] >= 1).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(valid=[48], seq_len=48, prompt_len=4), "valid\\[0\\]=48"),
        (dict(valid=[44], seq_len=48), "valid\\[0\\]=44"),  # a drawn prompt needs 4 + 1 tokens
        (dict(valid=[3], seq_len=48, prompt_len=0), "prompt_len"),
    ],
)
def test_rows_that_do_not_fit_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        data.skewed_batch(0, **kwargs)


def _device_units(lab: np.ndarray, unit: str) -> list[int]:
    return data.units(lab, unit).reshape(lab.shape[0], -1).sum(-1).tolist()


@pytest.mark.parametrize("devices,k", LAYOUTS)
@pytest.mark.parametrize("deal", ["skewed", "empty_device"])
@pytest.mark.parametrize("unit", data.UNITS)
def test_layout_holds_every_row_once_and_is_unequal(devices, k, deal, unit):
    tokens, labels = data.skewed_batch(devices * 10 + k, rows=16, seq_len=64)
    tok, lab = data.split_rows(tokens, labels, devices, k, deal=deal)
    assert tok.shape[:2] == (devices, k)
    flat_t, flat_l = tok.reshape(-1, tok.shape[-1]), lab.reshape(-1, lab.shape[-1])
    real = [i for i in range(len(flat_t)) if (flat_t[i] != PAD_TOKEN).any()]
    # every sample exactly once; every other row padding with no label
    assert sorted(map(bytes, flat_t[real])) == sorted(map(bytes, tokens))
    assert (flat_l[[i for i in range(len(flat_t)) if i not in real]] == IGNORE_INDEX).all()
    per_micro = data.units(lab, unit).sum(-1)  # [devices, k]
    assert per_micro.sum() == data.units(labels, unit).sum()  # the window count N, exactly
    per_device = _device_units(lab, unit)
    assert len(set(per_device)) == devices  # every device a different count
    if devices * k > 1:
        assert (per_micro == 0).any()  # a micro-batch with no loss unit
    if devices > 1 and (k == 1 or deal == "empty_device"):
        assert per_device[-1] == 0  # ... the whole last device


def test_in_order_deal_is_consecutive_chunks():
    tokens, labels = data.skewed_batch(0, TORCH_VALID, seq_len=48, prompt_len=4, vocab=256)
    tok, lab = data.split_rows(tokens, labels, 2, 2, deal="in_order")
    assert np.array_equal(tok.reshape(8, 48), tokens)  # rank 0: rows 0-3, rank 1: rows 4-7
    # tinygpt.torch_testing's documented layouts of its default lengths (exact)
    assert _device_units(lab, "token") == [49, 91]
    assert data.units(lab, "token").sum(-1)[0].tolist() == [49, 0]
    with pytest.raises(ValueError, match="devices \\* k = 3"):
        data.split_rows(tokens, labels, 3, 1, deal="in_order")


def test_split_is_proportional_and_exact():
    assert data.split(14, [1, 2, 3, 4]) == [1, 3, 4, 6]  # 1.4, 2.8, 4.2, 5.6: largest remainders
    assert data.split(5, [1.0, 1.0]) == [3, 2]
    assert sum(data.split(13, [0, 1, 2, 3])) == 13


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="deal"):
        data.assignment(np.ones(4), 2, 2, deal="random")
    with pytest.raises(ValueError, match="unit"):
        data.units(np.zeros((1, 4), np.int32), "tokens")
