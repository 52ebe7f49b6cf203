"""Hand-computed causal-LM loss sums and counts, token and sample units."""

from __future__ import annotations

import math

import pytest
import torch

from torch_ref import causal_lm_loss_sum, count_items

LN2 = math.log(2.0)


def _example() -> tuple[torch.Tensor, torch.Tensor]:
    """B=3, T=3, V=4. Position t predicts labels[:, t+1].

    sample 0: labels [7, 2, 0]: pos 0 logits [0, 0, ln 3, 0] -> p(2) = 3/6 -> ln 2;
              pos 1 logits 0 -> p(0) = 1/4 -> ln 4. (labels[0][0] = 7 is never a target.)
    sample 1: labels [-100, -100, 1]: only pos 1 -> ln 4.
    sample 2: all -100: no loss unit at all.
    """
    logits = torch.zeros(3, 3, 4)
    logits[0, 0, 2] = math.log(3.0)
    logits[2] = torch.randn(3, 4)  # anything: it must not matter
    labels = torch.tensor([[7, 2, 0], [-100, -100, 1], [-100, -100, -100]])
    return logits.requires_grad_(), labels


def test_token_unit_hand_computed():
    logits, labels = _example()
    loss_sum, count = causal_lm_loss_sum(logits, labels, "token")
    # ln 2 + ln 4 + ln 4 = 5 ln 2 over 3 tokens; float32 log/exp rounding ~1e-7.
    assert count == 3 == count_items(labels, "token")
    assert abs(loss_sum.item() - 5 * LN2) <= 1e-6
    loss_sum.backward()
    # The sample without labels gets exactly zero gradient (masked, not approximated).
    assert logits.grad[2].abs().max().item() == 0.0


def test_sample_unit_hand_computed():
    logits, labels = _example()
    loss_sum, count = causal_lm_loss_sum(logits, labels, "sample")
    # sample 0 mean (ln 2 + ln 4) / 2 = 1.5 ln 2, sample 1: 2 ln 2; sample 2 not a unit.
    assert count == 2 == count_items(labels, "sample")
    assert abs(loss_sum.item() - 3.5 * LN2) <= 1e-6  # float32 rounding
    loss_sum.backward()
    assert logits.grad[2].abs().max().item() == 0.0


def test_all_ignored_is_zero_but_differentiable():
    logits = torch.randn(2, 5, 4, requires_grad=True)
    labels = torch.full((2, 5), -100)
    for unit in ("token", "sample"):
        loss_sum, count = causal_lm_loss_sum(logits, labels, unit)
        assert count == 0
        assert loss_sum.item() == 0.0  # an empty sum is exactly 0, not NaN
        (grad,) = torch.autograd.grad(loss_sum, logits)
        assert grad.abs().max().item() == 0.0  # connected to the graph, zero gradient


def test_bad_unit():
    with pytest.raises(ValueError, match="unit: expected one of"):
        count_items(torch.zeros(1, 2, dtype=torch.long), "tokens")
