"""The losses refuse what they would otherwise sum wrong: shapes that broadcast, labels
that wrap, weights passed as a mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxaccum import losses

LOGITS = jnp.log(jnp.array([[[0.1, 0.2, 0.3, 0.4]] * 4]))  # [1, T=4, V=4]: known log-probs


def test_a_label_outside_the_vocabulary_is_refused_or_poisons_the_loss():
    # -1 would pick class V - 1 (NumPy-style wrapping) and count as a token: padding marked
    # -1 with the default ignore_index -100 would train on padding
    labels = jnp.array([[0, -1, 2, 3]])
    with pytest.raises(ValueError, match=r"labels.*\[0, 4\) or equal ignore_index=-100.*\[-1\]"):
        losses.causal_lm(LOGITS, labels)
    with pytest.raises(ValueError, match=r"got \[4\]"):
        losses.causal_lm_per_sample(LOGITS, jnp.array([[0, 4, 2, 3]]))
    # under jit the labels are traced: the loss and its gradient are NaN (a skipped window)
    value_and_grad = jax.jit(jax.value_and_grad(lambda x, y: losses.causal_lm(x, y)[0]))
    loss_sum, grad = value_and_grad(LOGITS, labels)
    assert np.isnan(float(loss_sum)) and np.all(np.isnan(grad[0, 0]))
    # valid labels: the same loss as before, exactly: -log 0.3 - log 0.4
    loss_sum, num_items = jax.jit(losses.causal_lm)(LOGITS, jnp.array([[0, -100, 2, 3]]))
    expected = -np.log(np.float32(0.3)) - np.log(np.float32(0.4))
    assert float(num_items) == 2.0 and abs(float(loss_sum) - expected) <= 1e-6  # f32 log
    # the ignore index may be any value, inside the vocabulary too
    assert float(losses.causal_lm(LOGITS, jnp.array([[0, 0, 2, 3]]), ignore_index=0)[1]) == 2.0


def test_per_sample_refuses_shapes_that_would_broadcast_and_weights_as_a_mask():
    # a [B, 1] head against a [B] mask broadcasts to [B, B] under default rank promotion
    with pytest.raises(ValueError, match=r"sample_losses.*\[B\].*\(2, 1\).*squeeze"):
        losses.per_sample(jnp.array([[1.0], [4.0]]), jnp.array([True, False]))
    with pytest.raises(ValueError, match=r"mask.*\(2,\), bool or 0/1 ints; got float32\[2\]"):
        losses.per_sample(jnp.array([1.0, 4.0]), jnp.array([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"mask.*got bool\[3\]"):
        losses.per_sample(jnp.array([1.0, 4.0]), jnp.array([True, False, True]))
    # 0/1 ints are a mask: exact sums of small floats
    loss_sum, num_items = losses.per_sample(jnp.array([1.0, 4.0, 2.0]), jnp.array([1, 0, 1]))
    assert (float(loss_sum), float(num_items)) == (3.0, 2.0)
