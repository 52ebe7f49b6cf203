"""The per-token loss of TRL 1.16's GRPO-family loss types: `policy_token_loss`.

The importance ratio (per token or per sequence), the clipped surrogate and its
variants (cispo's truncated weight, sapo's soft gate, vespo's gamma weights),
TRL's KL term; reduce the result with `jaxaccum.losses.policy_gradient`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxaccum._policy_gradient import check_loss_type, check_same_shape
from jaxaccum._state import at_least_float32

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")

# TRL clamps VESPO's sequence log-weight to [log(1e-8), 20] and each token's log-ratio to +-20.
_VESPO_LOG_W_MIN = math.log(1e-8)
_LOG_RATIO_MAX = 20.0


def policy_token_loss(
    logps: jax.Array,
    old_logps: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    loss_type: str,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    beta: float = 0.0,
    ref_logps: jax.Array | None = None,
    use_bias_correction_kl: bool = True,
) -> jax.Array:
    """The per-token loss of a GRPO-family loss type, as TRL 1.16's ``GRPOTrainer`` computes it.

    With ``r = exp(logps - old_logps)`` per token (``importance_sampling_level=
    "token"``) or ``exp`` of its masked mean over the sequence (``"sequence"``),
    ``A`` the advantage, ``eps_l = epsilon``, ``eps_h = epsilon_high`` (default
    ``epsilon``) and ``sg`` the stop-gradient:

    .. math::

       \\text{grpo, bnpo, dr\\_grpo, dapo, luspo: } l = -\\min(\\min(r, \\delta) A,\\;
           \\mathrm{clip}(r, 1 - \\epsilon_l, 1 + \\epsilon_h) A)

       \\text{cispo: } l = -\\mathrm{sg}(\\min(r, \\epsilon_h))\\, A \\log\\pi
       \\qquad \\text{sapo: } l = -\\frac{4}{\\tau}\\,\\sigma(\\tau (r - 1))\\, A,
       \\; \\tau = \\tau_+ \\text{ if } A > 0 \\text{ else } \\tau_-

       \\text{vespo: } l = -\\mathrm{sg}(\\phi) A \\log\\pi,\\;
       \\phi = e^{\\lambda + k \\log w - \\lambda w},\\;
       \\log w = \\mathrm{clip}(\\textstyle\\sum_t m_t \\log r_t, \\log 10^{-8}, 20)

    (``min(r, delta)`` only when ``delta`` is set; VESPO's ``(k, lambda)`` are the
    ``pos`` pair for ``A >= 0``, else ``neg``, and its ``w`` is always the token
    ratios' product, whatever ``importance_sampling_level``.) With ``beta != 0``
    TRL's KL term is added: ``beta * (exp(ref - logps) - (ref - logps) - 1)``,
    times ``r`` when ``use_bias_correction_kl``. Not modelled: vLLM's
    importance-sampling correction, the off-policy mask, the entropy mask and
    bonus (TRL's defaults leave them off). Reduce with :func:`policy_gradient`.

    Args:
      logps: ``[..., T]`` the policy's log-probs of the completion tokens
        (differentiated).
      old_logps: ``[..., T]`` the log-probs of the policy that sampled them, or
        None for ``stop_gradient(logps)`` (TRL's on-policy case).
      advantages: ``[...]`` one per sequence, or ``[..., T]`` one per token.
      mask: ``[..., T]`` bool or 0/1 (non-negative weights), the completion
        tokens that carry loss.
      loss_type: one of :data:`LOSS_TYPES`.
      epsilon: ``GRPOConfig``'s field of this name, as are ``epsilon_high``,
        ``delta``, ``importance_sampling_level``, ``sapo_temperature_pos``,
        ``sapo_temperature_neg``, ``vespo_k_pos``, ``vespo_lambda_pos``,
        ``vespo_k_neg``, ``vespo_lambda_neg``, ``beta`` and
        ``use_bias_correction_kl``, with its defaults (TRL recommends
        ``"sequence"`` for ``luspo``).
      ref_logps: ``[..., T]`` the reference model's log-probs; needed when
        ``beta != 0``.

    Returns:
      ``[..., T]`` the per-token loss (at least float32), 0 where ``mask`` is
      off: entries under the mask (any value, inf or NaN) never reach the
      result or its gradient.

    Raises:
      ValueError: an unknown ``loss_type`` or ``importance_sampling_level``;
        shapes that differ; ``beta != 0`` without ``ref_logps``.
      TypeError: a traced ``beta``.

    Example:
      >>> import jax.numpy as jnp
      >>> logps = jnp.log(jnp.array([[0.5, 0.3]]))
      >>> old = jnp.log(jnp.array([[0.25, 0.3]]))  # ratios 2 and 1
      >>> for loss_type in ("dapo", "cispo", "sapo", "vespo"):
      ...   l = policy_token_loss(logps, old, jnp.array([1.0]), jnp.array([[1, 1]]),
      ...                         loss_type=loss_type)
      ...   print(loss_type, [round(float(x), 4) for x in l[0]])
      dapo [-1.2, -1.0]
      cispo [0.1386, 0.2408]
      sapo [-2.9242, -2.0]
      vespo [0.138, 0.2398]
    """
    _check_token_options(loss_type, importance_sampling_level, beta, ref_logps)
    logps, old_logps, ref_logps, advantages, weights = _token_inputs(
        logps, old_logps, ref_logps, advantages, mask
    )
    log_ratio = logps - old_logps  # 0 under the mask (_token_inputs)
    ratio = jnp.exp(_log_importance_weights(log_ratio, weights, importance_sampling_level))
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if loss_type == "cispo":  # the truncated IS weight, held constant
        loss = -jax.lax.stop_gradient(jnp.minimum(ratio, epsilon_high)) * advantages * logps
    elif loss_type == "sapo":  # a soft gate instead of the clip
        tau = jnp.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        loss = -jax.nn.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantages
    elif loss_type == "vespo":
        pos, neg = (vespo_k_pos, vespo_lambda_pos), (vespo_k_neg, vespo_lambda_neg)
        loss = -_gamma_weights(log_ratio, weights, advantages, pos, neg) * advantages * logps
    else:  # grpo, bnpo, dr_grpo, dapo, luspo: PPO's clipped surrogate
        clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
        capped = ratio if delta is None else jnp.minimum(ratio, delta)  # two-sided clipping
        loss = -jnp.minimum(capped * advantages, clipped * advantages)
    if beta != 0.0:
        ref_gap = ref_logps - logps
        kl = jnp.exp(ref_gap) - ref_gap - 1.0
        loss = loss + beta * (kl * ratio if use_bias_correction_kl else kl)
    return jnp.where(weights != 0, jnp.broadcast_to(loss, weights.shape), 0.0)


def _log_importance_weights(log_ratio: jax.Array, weights: jax.Array, level: str) -> jax.Array:
    """``log r``: per token (``[..., T]``) or the masked mean over the sequence (``[..., 1]``)."""
    if level == "token":
        return log_ratio
    tokens = jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1.0)
    return jnp.sum(log_ratio * weights, axis=-1, keepdims=True) / tokens


def _gamma_weights(
    log_ratio: jax.Array,
    weights: jax.Array,
    advantages: jax.Array,
    pos: tuple[float, float],
    neg: tuple[float, float],
) -> jax.Array:
    """VESPO's ``phi(w) = exp(lambda + k log w - lambda w)`` per sequence, held constant.

    TRL's ``GRPOTrainer.get_gamma_weights`` (without vLLM's correction): ``log w``
    sums the clamped token log-ratios; ``(k, lambda)`` is ``pos`` for ``A >= 0``.
    """
    log_ratio = jax.lax.stop_gradient(log_ratio)
    clamped = jnp.clip(log_ratio, -_LOG_RATIO_MAX, _LOG_RATIO_MAX) * weights
    log_w = jnp.clip(jnp.sum(clamped, axis=-1, keepdims=True), _VESPO_LOG_W_MIN, _LOG_RATIO_MAX)
    non_negative = advantages >= 0
    k = jnp.where(non_negative, pos[0], neg[0])
    lam = jnp.maximum(jnp.where(non_negative, pos[1], neg[1]), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


def _token_inputs(
    logps: jax.Array,
    old_logps: jax.Array | None,
    ref_logps: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array, jax.Array]:
    """Checks the shapes; casts to at least float32; 0 under the mask; advantages ``[..., 1|T]``."""
    logps, mask, advantages = jnp.asarray(logps), jnp.asarray(mask), jnp.asarray(advantages)
    if old_logps is None:
        old_logps = jax.lax.stop_gradient(logps)
    others = {"old_logps": jnp.asarray(old_logps)}
    if ref_logps is not None:
        others["ref_logps"] = jnp.asarray(ref_logps)
    check_same_shape("policy_token_loss", logps=logps, mask=mask, **others)
    if advantages.shape not in (mask.shape[:-1], mask.shape):
        raise ValueError(
            "policy_token_loss: `advantages` must be [...] (one per sequence) or [..., T]"
            f" (one per token) for a mask of shape {mask.shape}; got {advantages.shape}."
        )
    dtype = at_least_float32(logps.dtype)
    weights = mask.astype(dtype)
    clean = lambda x: jnp.where(weights != 0, x.astype(dtype), 0.0)
    if advantages.ndim < mask.ndim:
        advantages = advantages[..., None]
    # a sequence ratio gathers every token's gradient: a NaN advantage under the mask would
    # reach it as 0 * NaN, so the advantages too are 0 there
    advantages = clean(jnp.broadcast_to(advantages, mask.shape))
    ref = None if ref_logps is None else clean(others["ref_logps"])
    return clean(logps), clean(others["old_logps"]), ref, advantages, weights


def _check_token_options(
    loss_type: object, importance_sampling_level: object, beta: float, ref_logps: object
) -> None:
    check_loss_type(loss_type, "policy_token_loss")
    if isinstance(beta, jax.core.Tracer):
        raise TypeError(
            "policy_token_loss: `beta` must be a Python float (GRPOConfig's, fixed for the"
            " run: it decides whether the KL term is computed); got a traced value. Close"
            " over it, or mark it static in jax.jit."
        )
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            "policy_token_loss: `importance_sampling_level` must be one of"
            f" {IMPORTANCE_SAMPLING_LEVELS}; got {importance_sampling_level!r}."
        )
    if beta != 0.0 and ref_logps is None:
        raise ValueError(
            f"policy_token_loss: beta={beta!r} adds a KL term to the reference model;"
            " pass ref_logps= its [..., T] log-probs (or beta=0.0)."
        )
