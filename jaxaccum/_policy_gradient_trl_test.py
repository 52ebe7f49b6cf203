"""Parity with TRL itself: ``GRPOTrainer._compute_loss`` (TRL 1.16) on the same tensors.

TRL's method runs unchanged on a stand-in for the trainer (:func:`trl_compute_loss`):
an object with the attributes ``_compute_loss`` reads, whose
``_get_per_token_logps_and_entropies`` hands back the given log-probs as a leaf
tensor that requires grad (no model, no forward pass). Per loss type, on one
micro-batch (``k = 1``, one process) of sequences of different lengths, ratios
far from 1 (the clip acts) and advantages of both signs:

* the per-token loss equals :func:`jaxaccum.losses.policy_token_loss` on every
  valid token. TRL multiplies it by the entropy mask right after computing it
  (``grpo_trainer.py:3143``); with ``top_entropy_quantile < 1`` the stand-in's
  ``get_high_entropy_mask`` returns :class:`Recorder`, which keeps every token
  (the product is the loss itself) and keeps a copy. TRL adds ``beta * KL`` a
  line later, so the copy is the policy term: the KL term is compared through
  the loss and its gradient;
* TRL's loss equals ``loss_sum / num_items`` of :func:`jaxaccum.losses.policy_gradient`
  (the loss type's one-batch objective), and so does its gradient with
  respect to the log-probs, token by token.

Needs torch and trl (``make test``); skipped where they are missing (the newest-JAX
job has no torch).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxaccum import losses
from jaxaccum._policy_gradient import LOSS_TYPES

pytestmark = pytest.mark.slow  # importing trl (transformers) takes seconds: make test only

B, T = 6, 7
LENGTHS = np.array([7, 3, 5, 1, 6, 2])  # completion tokens per row, all different
CASES = [  # (loss_type, GRPOConfig fields): every type, and the options that change its formula
    ("grpo", {}),
    ("grpo", {"importance_sampling_level": "sequence"}),  # GSPO
    ("grpo", {"beta": 0.04}),  # the KL term, times the ratio (use_bias_correction_kl)
    ("bnpo", {}),
    ("dr_grpo", {}),
    ("dapo", {}),
    ("dapo", {"epsilon_high": 0.28, "delta": 1.5}),  # DAPO's clip-higher, two-sided clipping
    ("dapo", {"beta": 0.04, "use_bias_correction_kl": False}),
    ("cispo", {}),
    ("cispo", {"epsilon_high": 5.0}),  # the ScaleRL value
    ("sapo", {}),
    ("luspo", {"importance_sampling_level": "sequence"}),
    ("vespo", {}),
]
# float32 throughout: exp, log and sigmoid of O(1) numbers agree between the two libraries to a
# few ulps (~1e-7 relative) and the sums run over at most 24 tokens in another order; 1e-5 leaves
# 100x room. The absolute parts cover values that cancel to ~0 (advantages of both signs).
PER_TOKEN_RTOL, PER_TOKEN_ATOL = 1e-5, 1e-6
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5


@pytest.fixture(scope="module")
def trl():
    """``(torch, GRPOTrainer, GRPOConfig)``, offline; the test is skipped without them."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
        os.environ.setdefault(name, "1")
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    from trl import GRPOConfig, GRPOTrainer

    return torch, GRPOTrainer, GRPOConfig


def rollouts(seed: int = 0) -> dict[str, np.ndarray]:
    """Log-probs, old log-probs (ratios from ~0.4 to ~2.5), reference log-probs, advantages."""
    rng = np.random.default_rng(seed)
    logps = np.log(rng.uniform(0.05, 0.95, (B, T)))
    mask = np.arange(T) < LENGTHS[:, None]
    return {
        "logps": logps.astype(np.float32),
        "old_logps": (logps + rng.normal(0, 0.4, (B, T))).astype(np.float32),
        "ref_logps": (logps + rng.normal(0, 0.3, (B, T))).astype(np.float32),
        "advantages": np.array([1.2, -0.7, 0.4, -1.5, 0.9, -0.2], np.float32),
        "mask": mask.astype(np.int64),
    }


class Recorder:
    """The entropy mask TRL multiplies the per-token loss by: keeps every token, and a copy."""

    per_token_loss = None

    def __rmul__(self, per_token_loss):
        self.per_token_loss = per_token_loss.detach().clone()
        return per_token_loss


def trl_compute_loss(
    trl, loss_type: str, data: dict, **fields
) -> tuple[float, np.ndarray, np.ndarray]:
    """TRL's ``_compute_loss`` on the given tensors: ``(loss, d loss / d logps, per-token loss)``.

    ``fields`` override ``GRPOConfig``'s defaults; one micro-batch, one process, ``k = 1``.
    """
    torch, GRPOTrainer, GRPOConfig = trl
    config = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    args = types.SimpleNamespace(**{**config, "steps_per_generation": 1, **fields})
    logps = torch.tensor(data["logps"], requires_grad=True)
    recorder, mask = Recorder(), torch.tensor(data["mask"])

    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **_):
        assert logits_to_keep == T and input_ids.shape == (B, 1 + T)
        return logps, torch.zeros(B, T), None

    trainer = types.SimpleNamespace(  # what _compute_loss reads of the trainer (beta=0: no KL)
        args=args, loss_type=loss_type, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        importance_sampling_level=args.importance_sampling_level, max_completion_length=T,
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies,
        top_entropy_quantile=0.5, get_high_entropy_mask=lambda *_: recorder,
        get_gamma_weights=GRPOTrainer.get_gamma_weights, off_policy_mask_threshold=None,
        aux_loss_enabled=False, _entropy_bonus_enabled=False, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1,
        model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda x: x,
                                          reduce=lambda x, reduction: x),
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
    )  # fmt: skip
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.int64),
        "prompt_mask": torch.ones(B, 1, dtype=torch.int64),
        "completion_ids": torch.zeros(B, T, dtype=torch.int64),
        "completion_mask": mask,
        "advantages": torch.tensor(data["advantages"]),
        "old_per_token_logps": torch.tensor(data["old_logps"]),
        "ref_per_token_logps": torch.tensor(data["ref_logps"]),
        "num_items_in_batch": mask.sum(),
    }
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    per_token = recorder.per_token_loss.expand(B, T)  # (B, 1) for a sequence-level ratio
    return loss.item(), logps.grad.numpy(), per_token.numpy()


def jaxaccum_loss(
    loss_type: str, data: dict, sequence_mask=None, **fields
) -> tuple[float, np.ndarray, np.ndarray]:
    """The same three with ``policy_token_loss`` and ``loss_sum / num_items``; the per-token
    loss without the KL term, as TRL's entropy mask sees it (TRL adds ``beta * KL`` after)."""

    def per_token(logps, kl=True):
        return losses.policy_token_loss(
            logps, data["old_logps"], data["advantages"], data["mask"], loss_type=loss_type,
            **{**fields, "beta": fields.get("beta", 0.0) if kl else 0.0},
            ref_logps=data["ref_logps"],
        )  # fmt: skip

    def objective(logps):
        loss_sum, num_items = losses.policy_gradient(
            per_token(logps), data["mask"], loss_type=loss_type, max_completion_length=T,
            sequence_mask=sequence_mask,
        )  # fmt: skip
        return loss_sum / num_items

    logps = jnp.asarray(data["logps"])
    loss, grad = jax.value_and_grad(objective)(logps)
    return float(loss), np.asarray(grad), np.asarray(per_token(logps, kl=False))


@pytest.mark.parametrize("loss_type, fields", CASES, ids=lambda c: str(c))
def test_per_token_loss_loss_and_gradient_are_trls(trl, loss_type, fields):
    data = rollouts()
    trl_loss, trl_grad, trl_token = trl_compute_loss(trl, loss_type, data, **fields)
    loss, grad, token = jaxaccum_loss(loss_type, data, **fields)
    valid = data["mask"] > 0
    np.testing.assert_allclose(
        token[valid], trl_token[valid], rtol=PER_TOKEN_RTOL, atol=PER_TOKEN_ATOL
    )
    assert np.all(token[~valid] == 0)  # TRL's masked entries are multiplied by 0 instead
    scale = np.mean(np.abs(trl_token[valid]))  # what the loss adds up: its rounding scale
    assert abs(loss - trl_loss) <= LOSS_RTOL * max(abs(trl_loss), scale)
    np.testing.assert_allclose(
        grad, trl_grad, rtol=GRAD_RTOL, atol=GRAD_RTOL * np.abs(trl_grad).max()
    )


@pytest.mark.parametrize("loss_type, fields", CASES, ids=lambda c: str(c))
def test_a_truncated_completion_masked_whole_counts_as_trl_counts_it(trl, loss_type, fields):
    # TRL's mask_truncated_completions=True zeroes a truncated completion's mask row and
    # keeps the row in its batch: sequence_mask says it is a completion, not padding
    data = rollouts()
    data["mask"][3] = 0  # the 1-token completion, truncated
    trl_loss, trl_grad, _ = trl_compute_loss(trl, loss_type, data, **fields)
    loss, grad, token = jaxaccum_loss(loss_type, data, sequence_mask=np.ones(B, bool), **fields)
    scale = np.mean(np.abs(token[data["mask"] > 0]))
    assert abs(loss - trl_loss) <= LOSS_RTOL * max(abs(trl_loss), scale)  # as above
    np.testing.assert_allclose(
        grad, trl_grad, rtol=GRAD_RTOL, atol=GRAD_RTOL * np.abs(trl_grad).max()
    )
    if loss_type in ("grpo", "sapo", "luspo", "dr_grpo"):  # they count sequences: 5 vs 6
        padding, _, _ = jaxaccum_loss(loss_type, data, **fields)  # the row read as padding
        assert padding == pytest.approx(trl_loss * B / (B - 1), rel=LOSS_RTOL, abs=1e-6)


def test_the_data_exercises_every_branch():
    data = rollouts()
    ratio = np.exp(data["logps"] - data["old_logps"])[data["mask"] > 0]
    # the clip (epsilon 0.2) acts on both sides; cispo truncates every ratio at its default
    # epsilon_high 0.2 and none at 5
    assert ratio.min() < 0.8 and ratio.max() > 1.2 and ratio.max() < 5.0
    assert (data["advantages"] > 0).any() and (data["advantages"] < 0).any()
    assert {loss_type for loss_type, _ in CASES} == set(LOSS_TYPES)


def test_defaults_are_grpo_configs(trl):
    _, _, GRPOConfig = trl
    config = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    signature = inspect.signature(losses.policy_token_loss).parameters
    shared = [name for name, p in signature.items() if name in config and p.kind == p.KEYWORD_ONLY]
    shared.remove("loss_type")  # required: TRL's default ("dapo") is no default of a loss
    assert len(shared) == 12, shared  # epsilon ... use_bias_correction_kl
    for name in shared:
        assert signature[name].default == config[name], name
