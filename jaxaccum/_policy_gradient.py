"""RL policy-gradient losses as (loss_sum, num_items): how TRL 1.16's eight loss types reduce.

GRPO-family trainers compute a per-token loss ``l_it`` (sequence ``i``, token
``t``) from the policy's log-probs, the log-probs that sampled the completions
and the advantages (:func:`policy_token_loss`, in ``_policy_token_loss.py``, as
``GRPOTrainer._compute_loss`` does), and reduce it over a completion mask
``m_it``. The reduction is the choice of a *loss unit*. TRL
(``GRPOTrainer._compute_loss``) reduces one micro-batch of ``B`` sequences as::

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

A "sequence" is, by default, a row of ``mask`` with at least one valid token: an
all-False row is padding. TRL counts every row of its batch, and with
``mask_truncated_completions=True`` it zeroes a truncated completion's whole row
and still counts it: pass ``sequence_mask`` (every real completion, truncated or
not) to count those rows too.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
"""TRL 1.16's GRPO loss types, the values of ``loss_type``."""

# the item each loss type counts (a slot: one of max_completion_length per sequence) ...
ITEMS = {
    "sequence": ("grpo", "sapo", "luspo"),
    "slot": ("dr_grpo",),
    "token": ("bnpo", "dapo", "cispo", "vespo"),
}
# ... and the types whose sequence is worth its token MEAN (the others: its token sum)
SEQUENCE_MEANS = ("grpo", "sapo")


def policy_gradient(
    per_token_loss: jax.Array,
    mask: jax.Array,
    *,
    loss_type: str,
    max_completion_length: int | None = None,
    sequence_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A GRPO-family loss as ``(loss_sum, num_items)`` for :func:`jaxaccum.multi_steps`.

    With ``m`` the mask, ``l`` the per-token loss, ``n_i = sum_t m_it`` the valid
    tokens of sequence ``i``, ``S`` the sequences (rows with ``n_i > 0``, or those of
    ``sequence_mask``) and
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
        tokens that carry loss (values are used as weights: non-negative).
      loss_type: one of :data:`LOSS_TYPES`.
      max_completion_length: the generation budget ``L`` in tokens, the constant
        ``dr_grpo`` divides by (required there, ignored otherwise); ``T``, the
        padded width, may exceed it, as TRL pads to ``pad_to_multiple_of``.
      sequence_mask: ``[...]`` (``mask``'s shape without ``T``), bool or 0/1: which
        rows are sequences, counted by ``grpo``, ``sapo``, ``luspo`` and ``dr_grpo``;
        a row outside it is padding for every loss type (its tokens carry no loss).
        Default: the rows with a valid token (an all-False row is padding). TRL
        counts every row: with its ``mask_truncated_completions=True``, which masks
        a truncated completion whole, pass the rows that are completions (all True
        where the batch has no padding) to get TRL's objective.

    Returns:
      ``(loss_sum, num_items)``, float32 scalars of this micro-batch: differentiate
      ``loss_sum``, pass ``num_items`` (and ``loss_sum``) to ``multi_steps.update``.

    Raises:
      ValueError: unknown ``loss_type``; ``dr_grpo`` without a positive
        ``max_completion_length``; shapes
        of ``per_token_loss`` and ``mask`` that differ, or a ``sequence_mask``
        whose shape is not ``mask``'s without its last axis.

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
    check_loss_type(loss_type, "policy_gradient")
    per_token_loss, mask = jnp.asarray(per_token_loss), jnp.asarray(mask)
    check_same_shape("policy_gradient", per_token_loss=per_token_loss, mask=mask)
    if loss_type == "dr_grpo":
        _check_max_completion_length(max_completion_length)

    is_sequence = _sequences(sequence_mask, mask)
    weights = jnp.where(is_sequence[..., None], mask.astype(jnp.float32), 0.0)  # padding: none
    token_loss = jnp.where(weights != 0, per_token_loss.astype(jnp.float32), 0.0) * weights
    tokens_per_sequence = jnp.sum(weights, axis=-1)
    sequences = jnp.sum(is_sequence).astype(jnp.float32)
    sequence_loss = jnp.sum(token_loss, axis=-1)
    item = next(item for item, types in ITEMS.items() if loss_type in types)
    if loss_type in SEQUENCE_MEANS:  # every sequence weighs the same, whatever its length
        has_tokens = tokens_per_sequence > 0  # one masked whole weighs 0 (TRL: 0 / 1)
        sequence_loss = sequence_loss / jnp.where(has_tokens, tokens_per_sequence, 1.0)
    loss_sum = jnp.sum(sequence_loss)
    if item == "sequence":
        return loss_sum, sequences
    if item == "slot":
        return loss_sum, sequences * jnp.float32(max_completion_length)
    return loss_sum, jnp.sum(tokens_per_sequence)  # tokens: one token mean of the window


def _sequences(sequence_mask: jax.Array | None, mask: jax.Array) -> jax.Array:
    """Which rows count as sequences: ``sequence_mask``'s, else those with a valid token."""
    if sequence_mask is None:
        return jnp.any(mask.astype(jnp.bool_), axis=-1)
    sequence_mask = jnp.asarray(sequence_mask)
    if sequence_mask.shape != mask.shape[:-1]:
        raise ValueError(
            "policy_gradient: `sequence_mask` must have `mask`'s shape without its last axis,"
            f" {mask.shape[:-1]}; got {sequence_mask.shape}."
        )
    return sequence_mask.astype(jnp.bool_)


def check_loss_type(loss_type: object, where: str) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"{where}: `loss_type` must be one of {LOSS_TYPES}; got {loss_type!r}.")


def check_same_shape(where: str, **arrays: jax.Array) -> None:
    shapes = {name: x.shape for name, x in arrays.items()}
    if len(set(shapes.values())) != 1 or min(len(s) for s in shapes.values()) < 1:
        names = " and ".join(f"`{name}`" for name in shapes)
        got = " and ".join(str(s) for s in shapes.values())
        raise ValueError(f"{where}: {names} must have the same shape [..., T]; got {got}.")


def _check_max_completion_length(max_completion_length: object) -> None:
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
