"""RL policy-gradient losses: TRL 1.16's eight loss types, per token and as (loss_sum, num_items).

GRPO-family trainers compute a per-token loss ``l_it`` (sequence ``i``, token
``t``) from the policy's log-probs, the log-probs that sampled the completions
and the advantages (:func:`policy_token_loss`, as ``GRPOTrainer._compute_loss``
does), and reduce it over a completion mask ``m_it``. The reduction is the
choice of a *loss unit*. TRL (``GRPOTrainer._compute_loss``) reduces one
micro-batch of ``B`` sequences as::

    grpo, sapo           mean_i ( sum_t m_it l_it / sum_t m_it )          then / grad_accum
    bnpo                 sum_it m_it l_it / sum_it m_it  (LOCAL tokens)    then / grad_accum
    dr_grpo              sum_it m_it l_it / (B * max_completion_length)    then / grad_accum
    luspo                mean_i ( sum_t m_it l_it )                        then / grad_accum
    dapo, cispo, vespo   sum_it m_it l_it / (N_window / world_size)

``N_window`` counts the tokens of the whole window on all ranks (TRL counts the
generation batch's and rescales it by ``grad_accum / steps_per_generation``: the
same when the two are equal).

Each type's *one-batch* objective (the whole window as one micro-batch on one
device) is a sum over the window divided by a count of the window. Written as
that sum and its items, :func:`jaxaccum.multi_steps` adds both over
micro-batches and devices and divides once, so the update is the one-batch
update for every cut of the window (:func:`policy_gradient`):

========================  =============================  =========================  ===============
loss_type                 loss_sum (a micro-batch's)     num_items (its)            unit
========================  =============================  =========================  ===============
grpo, sapo                sum_i of sequence token means  sequences                  a sequence
luspo                     sum of token losses            sequences                  a sequence
dr_grpo                   sum of token losses            sequences x max_compl_len  a constant slot
dapo, bnpo, cispo, vespo  sum of token losses            valid tokens               a token
========================  =============================  =========================  ===============

``bnpo`` is the one whose TRL reduction is not its one-batch objective: each
micro-batch takes its *local* token mean, so the window is a mean of means whose
value changes with ``k`` and the world size (``examples/08_rl_loss_units.py``).
Its one-batch objective is the token mean of the batch, which is ``dapo``'s unit.

A "sequence" is a row of ``mask`` with at least one valid token; an all-False
row is padding (TRL counts every row, but there every completion holds at least
its EOS token, so the two agree on real batches).
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")

# the item each loss type counts (a slot: one of max_completion_length per sequence) ...
ITEMS = {
    "sequence": ("grpo", "sapo", "luspo"),
    "slot": ("dr_grpo",),
    "token": ("bnpo", "dapo", "cispo", "vespo"),
}
# ... and the types whose sequence is worth its token MEAN (the others: its token sum)
SEQUENCE_MEANS = ("grpo", "sapo")

# TRL clamps VESPO's sequence log-weight to [log(1e-8), 20] and each token's log-ratio to +-20.
_VESPO_LOG_W_MIN = math.log(1e-8)
_LOG_RATIO_MAX = 20.0


def policy_gradient(
    per_token_loss: jax.Array,
    mask: jax.Array,
    *,
    loss_type: str,
    max_completion_length: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A GRPO-family loss as ``(loss_sum, num_items)`` for :func:`jaxaccum.multi_steps`.

    With ``m`` the mask, ``l`` the per-token loss, ``n_i = sum_t m_it`` the valid
    tokens of sequence ``i``, ``S`` the sequences (rows with ``n_i > 0``) and
    ``L = max_completion_length``:

    .. math::

       \\text{grpo, sapo: } \\Big(\\sum_{i \\in S} \\frac{\\sum_t m_{it} l_{it}}{n_i},\\; |S|\\Big)
       \\quad \\text{luspo: } \\Big(\\sum_{it} m_{it} l_{it},\\; |S|\\Big)

       \\text{dr\\_grpo: } \\Big(\\sum_{it} m_{it} l_{it},\\; |S| \\cdot L\\Big)
       \\quad \\text{dapo, bnpo, cispo, vespo: }
       \\Big(\\sum_{it} m_{it} l_{it},\\; \\sum_i n_i\\Big)

    The window ratio ``sum(loss_sum) / sum(num_items)`` is the loss type's
    one-batch objective (TRL's loss with ``k = 1`` on one device) for every
    cut of the window into micro-batches and devices.

    Args:
      per_token_loss: ``[..., T]`` float, the loss of every completion token
        (:func:`policy_token_loss`, plus anything else per token).
      mask: ``[..., T]``, same shape, bool or 0/1: which tokens are completion
        tokens that carry loss (values are used as weights).
      loss_type: one of :data:`LOSS_TYPES`.
      max_completion_length: the generation budget ``L`` in tokens; required
        for ``"dr_grpo"`` (and must be ``>= T``), ignored otherwise.

    Returns:
      ``(loss_sum, num_items)``, float32 scalars of this micro-batch: differentiate
      ``loss_sum``, pass ``num_items`` (and ``loss_sum``) to ``multi_steps.update``.

    Raises:
      ValueError: unknown ``loss_type``; ``dr_grpo`` without a positive
        ``max_completion_length`` or with ``T > max_completion_length``; shapes
        of ``per_token_loss`` and ``mask`` that differ.

    Example:
      >>> import jax.numpy as jnp
      >>> loss = jnp.array([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]])
      >>> mask = jnp.array([[1, 1, 0], [1, 0, 0]])
      >>> for loss_type in ("grpo", "luspo", "dr_grpo", "dapo", "bnpo"):
      ...   s, n = policy_gradient(loss, mask, loss_type=loss_type, max_completion_length=4)
      ...   print(loss_type, float(s), float(n))
      grpo 4.0 2.0
      luspo 6.0 2.0
      dr_grpo 6.0 8.0
      dapo 6.0 3.0
      bnpo 6.0 3.0
    """
    _check_loss_type(loss_type, "policy_gradient")
    per_token_loss, mask = jnp.asarray(per_token_loss), jnp.asarray(mask)
    _check_same_shape("policy_gradient", per_token_loss=per_token_loss, mask=mask)
    if loss_type == "dr_grpo":
        _check_max_completion_length(max_completion_length, per_token_loss.shape[-1])

    weights = mask.astype(jnp.float32)
    token_loss = jnp.where(weights != 0, per_token_loss.astype(jnp.float32), 0.0) * weights
    tokens_per_sequence = jnp.sum(weights, axis=-1)
    is_sequence = tokens_per_sequence > 0
    sequences = jnp.sum(is_sequence).astype(jnp.float32)
    sequence_loss = jnp.sum(token_loss, axis=-1)
    item = next(item for item, types in ITEMS.items() if loss_type in types)
    if loss_type in SEQUENCE_MEANS:  # every sequence weighs the same, whatever its length
        sequence_loss = sequence_loss / jnp.where(is_sequence, tokens_per_sequence, 1.0)
    loss_sum = jnp.sum(jnp.where(is_sequence, sequence_loss, 0.0))
    if item == "sequence":
        return loss_sum, sequences
    if item == "slot":
        return loss_sum, sequences * jnp.float32(max_completion_length)
    return loss_sum, jnp.sum(tokens_per_sequence)  # tokens: one token mean of the window


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
      mask: ``[..., T]`` bool or 0/1, the completion tokens that carry loss.
      loss_type: one of :data:`LOSS_TYPES`.
      epsilon, epsilon_high, delta, importance_sampling_level,
        sapo_temperature_pos, sapo_temperature_neg, vespo_k_pos,
        vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg, beta,
        use_bias_correction_kl: ``GRPOConfig``'s fields of these names, with
        its defaults (TRL recommends ``"sequence"`` for ``luspo``).
      ref_logps: ``[..., T]`` the reference model's log-probs; needed when
        ``beta != 0``.

    Returns:
      ``[..., T]`` the per-token loss (at least float32), 0 where ``mask`` is
      off: entries under the mask (any value, inf or NaN) never reach the
      result or its gradient.

    Raises:
      ValueError: an unknown ``loss_type`` or ``importance_sampling_level``;
        shapes that differ; ``beta != 0`` without ``ref_logps``.

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
    _check_same_shape("policy_token_loss", logps=logps, mask=mask, **others)
    if advantages.shape not in (mask.shape[:-1], mask.shape):
        raise ValueError(
            "policy_token_loss: `advantages` must be [...] (one per sequence) or [..., T]"
            f" (one per token) for a mask of shape {mask.shape}; got {advantages.shape}."
        )
    dtype = jnp.promote_types(logps.dtype, jnp.float32)
    weights = mask.astype(dtype)
    clean = lambda x: jnp.where(weights != 0, x.astype(dtype), 0.0)
    if advantages.ndim < mask.ndim:
        advantages = advantages[..., None]
    ref = None if ref_logps is None else clean(others["ref_logps"])
    return clean(logps), clean(others["old_logps"]), ref, advantages.astype(dtype), weights


def _check_token_options(
    loss_type: object, importance_sampling_level: object, beta: float, ref_logps: object
) -> None:
    _check_loss_type(loss_type, "policy_token_loss")
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


def _check_loss_type(loss_type: object, where: str) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"{where}: `loss_type` must be one of {LOSS_TYPES}; got {loss_type!r}.")


def _check_same_shape(where: str, **arrays: jax.Array) -> None:
    shapes = {name: x.shape for name, x in arrays.items()}
    if len(set(shapes.values())) != 1 or min(len(s) for s in shapes.values()) < 1:
        names = " and ".join(f"`{name}`" for name in shapes)
        got = " and ".join(str(s) for s in shapes.values())
        raise ValueError(f"{where}: {names} must have the same shape [..., T]; got {got}.")


def _check_max_completion_length(max_completion_length: object, tokens: int) -> None:
    if (
        max_completion_length is None
        or isinstance(max_completion_length, bool)
        or not isinstance(max_completion_length, numbers.Integral)
        or max_completion_length < 1
    ):
        raise ValueError(
            "policy_gradient: loss_type='dr_grpo' divides by the constant"
            " sequences x `max_completion_length`; pass max_completion_length="
            f" a positive int (the generation budget); got {max_completion_length!r}."
        )
    if tokens > max_completion_length:
        raise ValueError(
            f"policy_gradient: `per_token_loss` has {tokens} tokens per sequence, more than"
            f" max_completion_length={max_completion_length}."
        )
