"""The project's data, numpy only: skewed samples and how a window lays them out.

Every test, example, benchmark and the parity suite draws its token data here.
One generator, :func:`skewed_batch`: rows of ``prompt + response`` then padding,
labels -100 but on the response (so a row holds its response length of valid
tokens after the causal shift, :func:`valid_tokens`), response lengths given or
drawn from :data:`LENGTH_MIX` (per 16 rows: 2 empty, 6 of 2-5 tokens, 2 of
20-40, 6 of 90-110: what makes every wrong normalization visible), tokens the
bytes of the embedded corpus (``tinygpt/corpus.txt``) or uniform ids. One
way to split a batch, :func:`split_rows`: ``[S, T]`` rows to ``[devices, k, mb, T]`` micro-batches,
every device a different count, one device or one micro-batch none
(:func:`assignment`; :func:`split_batches`: several windows, one ``mb``).

Example::

    >>> tokens, labels = skewed_batch(0, rows=16, seq_len=128)
    >>> n = valid_tokens(labels)
    >>> sorted(n.tolist())[:3], int(n.max())      # empty rows beside 100-token ones
    ([0, 0, 2], 109)
    >>> tok, lab = split_rows(tokens, labels, devices=2, k=2)
    >>> tok.shape[:2], valid_tokens(lab).sum(-1).tolist()   # valid tokens [device][micro-batch]
    ((2, 2), [[127, 5], [544, 0]])
    >>> valid_tokens(split_rows(tokens, labels, 3, 2, deal="empty_device")[1]).sum(-1).tolist()
    [[127, 5], [312, 232], [0, 0]]
"""

from __future__ import annotations

import functools
import math
import pathlib
from collections.abc import Sequence

import numpy as np

from bigbatch import IGNORE_INDEX

PAD_TOKEN = 0
UNITS = ("token", "sample")
DEALS = ("skewed", "empty_device", "in_order")
CORPUS_PATH = pathlib.Path(__file__).with_name("corpus.txt")
# Response lengths of every 16 rows: (how many, (low, high) valid tokens).
LENGTH_MIX = ((2, (0, 0)), (6, (2, 5)), (2, (20, 40)), (6, (90, 110)))
_PROMPT_ROOM = 5  # a drawn prompt holds 4 tokens or more: responses <= T - 5


@functools.lru_cache(maxsize=1)
def corpus_bytes() -> bytes:
    """The embedded corpus (``tinygpt/corpus.txt``, plain ASCII prose) as bytes."""
    return CORPUS_PATH.read_bytes()


def _mixed_lengths(rng: np.random.Generator, rows: int, max_valid: int) -> list[int]:
    """``rows`` response lengths of :data:`LENGTH_MIX` (at least one empty row), shuffled."""
    reps = max(1, math.ceil(rows / 16))
    lengths = []
    for n, (lo, hi) in LENGTH_MIX:
        lengths += [int(rng.integers(lo, hi + 1)) for _ in range(n * reps)]
    lengths = [min(n, max_valid) for n in lengths]
    # Keep the mix (the empty rows first, so that a cut keeps at least one).
    empties = [n for n in lengths if n == 0][: max(1, round(rows * 2 / 16))]
    rest = [n for n in lengths if n > 0]
    rng.shuffle(rest)
    lengths = empties + rest[: rows - len(empties)]
    rng.shuffle(lengths)
    return lengths


def _prompt_len(rng: np.random.Generator, n_valid: int, seq_len: int, prompt_len: int | None):
    """The masked prefix of a row: ``min(prompt_len, T - n_valid)``, or drawn (``None``)."""
    if prompt_len is not None:
        return min(prompt_len, seq_len - n_valid)
    if n_valid == 0:  # a prompt so long that the response was truncated away
        return int(rng.integers(seq_len // 2, seq_len + 1))
    return int(rng.integers(4, max(5, min(24, seq_len - n_valid))))


def skewed_batch(
    seed: int | np.random.Generator,
    valid: Sequence[int] | None = None,
    *,
    rows: int = 16,
    seq_len: int = 128,
    prompt_len: int | None = None,
    vocab: int | None = None,
    dtype=np.int32,
) -> tuple[np.ndarray, np.ndarray]:
    """A global batch ``(tokens, labels)`` ``[rows, seq_len]`` of skewed response lengths.

    Row ``i``: a prompt (label -100), ``valid[i]`` response tokens (label = the
    token), then padding (token ``PAD_TOKEN``, label -100): ``valid[i]`` valid
    tokens after the causal shift.

    Args:
      seed: a numpy seed, or a ``np.random.Generator`` (every call advances it:
        a run of batches from one generator).
      valid: the response length of each row; None: ``rows`` lengths of
        :data:`LENGTH_MIX` (capped to fit the row), at least one of them 0.
      rows: how many rows to draw when ``valid`` is None.
      seq_len: T.
      prompt_len: every row's prompt, ``min(prompt_len, T - valid[i])`` tokens
        (``valid[i] <= T - 1``); None: drawn per row, 4 to 23 tokens or half the
        row or more for an empty one (``valid[i] <= T - 5``).
      vocab: None: tokens are consecutive corpus bytes; an int: ids drawn
        uniformly from ``[1, vocab)``.
      dtype: of both arrays.

    Returns:
      ``(tokens, labels)``, ``dtype`` ``[rows, seq_len]``.

    Raises:
      ValueError: a response length that does not fit the row, or ``prompt_len < 1``.

    Example:
      >>> tok, lab = skewed_batch(0, [2, 0, 5], seq_len=8, prompt_len=1, vocab=13)
      >>> valid_tokens(lab).tolist(), (lab[0] >= 0).astype(int).tolist()
      ([2, 0, 5], [0, 1, 1, 0, 0, 0, 0, 0])
    """
    if prompt_len is not None and prompt_len < 1:
        raise ValueError(f"prompt_len: expected >= 1 (label 0 is never a target), got {prompt_len}")
    rng = np.random.default_rng(seed)
    if valid is None:  # drawn lengths leave room for the whole prompt
        valid = _mixed_lengths(rng, rows, seq_len - (prompt_len or _PROMPT_ROOM))
    longest = seq_len - (_PROMPT_ROOM if prompt_len is None else 1)
    for i, v in [(i, v) for i, v in enumerate(valid) if not 0 <= v <= longest][:1]:
        raise ValueError(f"valid[{i}]={v}: expected 0 <= v <= {longest} (seq_len={seq_len})")
    ids = None if vocab is None else rng.integers(1, vocab, (len(valid), seq_len))
    text = corpus_bytes()
    tokens = np.full((len(valid), seq_len), PAD_TOKEN, dtype)
    labels = np.full((len(valid), seq_len), IGNORE_INDEX, dtype)
    for i, n_valid in enumerate(valid):
        prompt = _prompt_len(rng, n_valid, seq_len, prompt_len)
        end = prompt + n_valid
        if ids is None:
            start = int(rng.integers(0, len(text) - end))
            row = np.frombuffer(text[start : start + end], np.uint8)
        else:
            row = ids[i, :end]
        tokens[i, :end] = row
        labels[i, prompt:end] = row[prompt:]
    return tokens, labels


def valid_tokens(labels: np.ndarray) -> np.ndarray:
    """Valid tokens per row after the causal shift (``labels[..., 1:] != -100``)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum(-1)


def units(labels: np.ndarray, unit: str) -> np.ndarray:
    """Loss units per row: its valid tokens ("token") or 1 if it has any ("sample")."""
    if unit not in UNITS:
        raise ValueError(f"unit: expected one of {UNITS}, got {unit!r}")
    n = valid_tokens(labels)
    return n if unit == "token" else (n > 0).astype(n.dtype)


def split(n: int, weights: Sequence[float]) -> list[int]:
    """``n`` items into integer parts proportional to ``weights`` (largest remainder)."""
    total = sum(weights)
    raw = [n * w / total for w in weights]
    parts = [math.floor(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - parts[i], reverse=True)
    for i in order[: n - sum(parts)]:
        parts[i] += 1
    return parts


def assignment(
    n_valid: np.ndarray, devices: int, k: int, deal: str = "skewed"
) -> list[list[list[int]]]:
    """Which rows go to device ``r``, micro-batch ``m``: ``plan[r][m]`` = row indices.

    ``deal``:

    * ``"skewed"``: rows with a valid token are dealt, in batch order, to the
      devices in proportions 1 : 2 : ... : R, evenly over each device's
      micro-batches (where two devices would hold as many valid tokens, a row
      swaps with one of another length: rows enough, every device a different
      count); the rows without one form a micro-batch of their own, the last of
      the last device (``k == 1``: that whole device, nothing else on it).
    * ``"empty_device"``: the last device holds the rows without a valid token
      and nothing else (one device: as ``"skewed"``).
    * ``"in_order"``: ``devices * k`` equal consecutive chunks, device ``r``
      getting chunks ``r k .. r k + k - 1`` (the order of the rows decides the skew).

    Raises:
      ValueError: an unknown ``deal``; ``"in_order"`` rows that do not cut evenly.
    """
    if deal not in DEALS:
        raise ValueError(f"deal: expected one of {DEALS}, got {deal!r}")
    rows = list(range(len(n_valid)))
    size, left = divmod(len(rows), devices * k)
    if deal == "in_order" and left:
        raise ValueError(f"rows: {len(rows)} rows do not cut into devices * k = {devices * k}")
    if deal == "in_order" or devices * k == 1:
        return [[rows[(r * k + m) * size :][:size] for m in range(k)] for r in range(devices)]
    plan: list[list[list[int]]] = [[[] for _ in range(k)] for _ in range(devices)]
    empty = [i for i in rows if n_valid[i] == 0]
    full = [i for i in rows if n_valid[i] > 0]
    last = devices - 1
    if devices > 1 and (k == 1 or deal == "empty_device"):
        weights = [float(r + 1) for r in range(last)] + [0.0]
        empty_slots = list(range(k))
    else:
        weights = [float(r + 1) for r in range(devices)]
        empty_slots = [k - 1]
    shares = split(len(full), weights)
    full = _untie(full, shares, n_valid)
    start = 0
    for r in range(devices):
        mine = full[start : start + shares[r]]
        start += shares[r]
        slots = [m for m in range(k) if r != last or m not in empty_slots]
        _deal_evenly(plan[r], slots, mine)
    _deal_evenly(plan[last], empty_slots, empty)
    return plan


def _untie(order: list[int], shares: list[int], n_valid: np.ndarray) -> list[int]:
    """``order`` (``shares[r]`` rows to device ``r``, consecutively) with rows swapped between
    devices while two of them hold as many valid tokens (the shares stay; no tie: unchanged)."""
    bounds = np.cumsum([0, *shares])

    def ties(o: list[int]) -> list[int]:
        totals = [int(np.sum(n_valid[o[a:b]])) for a, b in zip(bounds, bounds[1:], strict=False)]
        return [r for r, total in enumerate(totals) if shares[r] and total in totals[:r]]

    def swapped(a: int, b: int) -> list[int]:
        o = list(order)
        o[a], o[b] = o[b], o[a]
        return o

    tied = ties(order)
    while tied:  # swap a row of the first tied device with one elsewhere: the fewest ties
        mine = range(bounds[tied[0]], bounds[tied[0] + 1])
        best = min(
            (swapped(a, b) for a in mine for b in range(len(order)) if b not in mine),
            key=lambda o: len(ties(o)),
        )
        if len(ties(best)) >= len(tied):
            break  # no swap helps (rows too few or too alike): leave it
        order, tied = best, ties(best)
    return order


def _deal_evenly(device_plan: list[list[int]], slots: list[int], rows: list[int]) -> None:
    """``rows`` over the micro-batches ``slots`` of one device, consecutive, evenly."""
    s = 0
    for m, n in zip(slots, split(len(rows), [1.0] * len(slots)), strict=True):
        device_plan[m] = rows[s : s + n]
        s += n


def split_rows(
    tokens: np.ndarray,
    labels: np.ndarray,
    devices: int,
    k: int,
    *,
    deal: str = "skewed",
    min_rows: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Cuts a global batch ``[S, T]`` into micro-batches ``[devices, k, mb, T]``.

    Rows go where :func:`assignment` (``deal``) puts them; ``mb`` is the most
    rows any micro-batch needs (at least ``min_rows``: one ``mb`` for several
    windows); padding rows have token ``PAD_TOKEN`` and label -100 everywhere
    (no loss unit, no gradient).
    """
    plan = assignment(valid_tokens(labels), devices, k, deal)
    mb = max(min_rows, max(len(rows) for device in plan for rows in device))
    out_tok = np.full((devices, k, mb) + tokens.shape[1:], PAD_TOKEN, tokens.dtype)
    out_lab = np.full((devices, k, mb) + labels.shape[1:], IGNORE_INDEX, labels.dtype)
    for r in range(devices):
        for m in range(k):
            rows = plan[r][m]
            out_tok[r, m, : len(rows)] = tokens[rows]
            out_lab[r, m, : len(rows)] = labels[rows]
    return out_tok, out_lab


def split_batches(
    batches: Sequence[tuple[np.ndarray, np.ndarray]],
    devices: int,
    ks: int | Sequence[int],
    *,
    deal: str = "skewed",
) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`split_rows` of every window's batch with one ``mb`` (the most any window needs: a
    jitted step compiles once); ``ks``: micro-batches per device, one or one per window."""
    ks = [ks] * len(batches) if isinstance(ks, int) else list(ks)
    plans = [
        assignment(valid_tokens(lab), devices, k, deal)
        for (_, lab), k in zip(batches, ks, strict=True)
    ]
    mb = max(len(rows) for plan in plans for device in plan for rows in device)
    return [
        split_rows(tok, lab, devices, k, deal=deal, min_rows=mb)
        for (tok, lab), k in zip(batches, ks, strict=True)
    ]
