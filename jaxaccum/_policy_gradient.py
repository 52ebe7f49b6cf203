"""RL policy-gradient losses as ``(loss_sum, num_items)``: TRL's four loss types.

GRPO-family trainers compute a per-token loss ``l_it`` (sequence ``i``, token
``t``; e.g. ``-min(ratio * A, clip(ratio) * A) + beta * KL``) and a completion
mask ``m_it``. They differ only in how the token losses are averaged, which is
the choice of a *loss unit*. TRL (``GRPOTrainer._compute_loss``) defines, for
one micro-batch::

    grpo     mean_i ( sum_t m_it l_it / sum_t m_it )        then / grad_accum
    bnpo     sum_it m_it l_it / sum_it m_it                  then / grad_accum
    dr_grpo  sum_it m_it l_it / (B * max_completion_length)  then / grad_accum
    dapo     sum_it m_it l_it / (N_window / world_size)      N_window: tokens of the window, all ranks

Written as a sum and its items, the big-batch loss of a window is
``sum(loss_sum) / sum(num_items)`` over all micro-batches of all devices, which is
what :func:`jaxaccum.multi_steps` computes. Each type below returns the sum and
items whose window ratio is that type's big-batch objective:

==========  ==============================  ============================  ==================
loss_type   loss_sum (per micro-batch)      num_items (per micro-batch)   unit
==========  ==============================  ============================  ==================
grpo        sum_i of sequence token means   sequences                     a sequence
bnpo        local token mean                1                             a micro-batch (!)
dr_grpo     sum of token losses             sequences x max_compl_len     a constant slot
dapo        sum of token losses             valid tokens                  a token
==========  ==============================  ============================  ==================

``grpo``, ``dr_grpo`` and ``dapo`` give the same window loss and gradient for
any split of the window into micro-batches and devices. ``bnpo`` is kept to
show the bug it is: its local token mean makes the window a mean of means, so
its value depends on how the window is cut (``examples/08_rl_loss_units.py``).

A "sequence" is a row of ``mask`` with at least one valid token; an all-False
row is padding (TRL counts every row, but there every completion holds at least
its EOS token, so the two agree on real batches).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


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

       \\text{grpo: } \\Big(\\sum_{i \\in S} \\frac{\\sum_t m_{it} l_{it}}{n_i},\\; |S|\\Big)
       \\quad \\text{bnpo: } \\Big(\\frac{\\sum_{it} m_{it} l_{it}}{\\max(1, \\sum_i n_i)},\\; 1\\Big)

       \\text{dr\\_grpo: } \\Big(\\sum_{it} m_{it} l_{it},\\; |S| \\cdot L\\Big)
       \\quad \\text{dapo: } \\Big(\\sum_{it} m_{it} l_{it},\\; \\sum_i n_i\\Big)

    Args:
      per_token_loss: ``[..., T]`` float, the loss of every completion token
        (policy term plus any KL term), already multiplied by nothing else.
      mask: ``[..., T]``, same shape, bool or 0/1: which tokens are completion
        tokens that carry loss (values are used as weights).
      loss_type: one of ``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"``.
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
      >>> for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
      ...   s, n = policy_gradient(loss, mask, loss_type=loss_type, max_completion_length=4)
      ...   print(loss_type, float(s), float(n))
      grpo 4.0 2.0
      bnpo 2.0 1.0
      dr_grpo 6.0 8.0
      dapo 6.0 3.0
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"policy_gradient: `loss_type` must be one of {LOSS_TYPES}; got {loss_type!r}."
        )
    per_token_loss = jnp.asarray(per_token_loss)
    mask = jnp.asarray(mask)
    if per_token_loss.ndim < 1 or per_token_loss.shape != mask.shape:
        raise ValueError(
            "policy_gradient: `per_token_loss` and `mask` must have the same shape"
            f" [..., T]; got {per_token_loss.shape} and {mask.shape}."
        )
    if loss_type == "dr_grpo":
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
        if per_token_loss.shape[-1] > max_completion_length:
            raise ValueError(
                "policy_gradient: `per_token_loss` has"
                f" {per_token_loss.shape[-1]} tokens per sequence, more than"
                f" max_completion_length={max_completion_length}."
            )

    weights = mask.astype(jnp.float32)
    token_loss = jnp.where(weights != 0, per_token_loss.astype(jnp.float32), 0.0) * weights
    tokens_per_sequence = jnp.sum(weights, axis=-1)
    is_sequence = tokens_per_sequence > 0
    sequences = jnp.sum(is_sequence).astype(jnp.float32)
    total = jnp.sum(token_loss)
    tokens = jnp.sum(tokens_per_sequence)

    if loss_type == "grpo":
        # Every sequence weighs the same, whatever its length.
        sequence_mean = jnp.sum(token_loss, axis=-1) / jnp.where(
            is_sequence, tokens_per_sequence, 1.0
        )
        return jnp.sum(jnp.where(is_sequence, sequence_mean, 0.0)), sequences
    if loss_type == "bnpo":
        # A local token mean counted as ONE unit: the window becomes a mean of
        # micro-batch means (TRL divides it by grad_accum; DDP averages ranks).
        return total / jnp.maximum(tokens, 1.0), jnp.ones((), jnp.float32)
    if loss_type == "dr_grpo":
        return total, sequences * jnp.float32(max_completion_length)
    return total, tokens.astype(jnp.float32)  # dapo: one global token mean
