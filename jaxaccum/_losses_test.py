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
    # valid labels: the loss and its gradient bitwise those of the cross entropy written out
    valid = np.array([[0, -100, 2, 3]])
    loss_sum, grad = value_and_grad(LOGITS, jnp.asarray(valid))

    def written_out(logits):  # positions 1 and 2 predict labels 2 and 3
        log_probs = jax.nn.log_softmax(logits[0, 1:3], axis=-1)
        return -(log_probs[0, 2] + log_probs[1, 3])

    expected, expected_grad = jax.jit(jax.value_and_grad(written_out))(LOGITS)
    assert float(loss_sum) == float(expected)
    np.testing.assert_array_equal(grad, expected_grad)
    # NumPy labels closed over under jit are concrete: checked, not traced (valid: no error)
    assert float(jax.jit(lambda x: losses.causal_lm(x, valid)[1])(LOGITS)) == 2.0
    with pytest.raises(ValueError, match=r"got \[-1\]"):
        jax.jit(lambda x: losses.causal_lm(x, np.array([[0, -1, 2, 3]]))[0])(LOGITS)
    # the ignore index may be any value, inside the vocabulary too
    assert float(losses.causal_lm(LOGITS, jnp.array([[0, 0, 2, 3]]), ignore_index=0)[1]) == 2.0


def test_per_sample_refuses_shapes_that_would_broadcast_and_weights_as_a_mask():
    # a [B, 1] head against a [B] mask broadcasts to [B, B] under default rank promotion
    with pytest.raises(ValueError, match=r"sample_losses.*\[B\].*\(2, 1\).*squeeze"):
        losses.per_sample(jnp.array([[1.0], [4.0]]), jnp.array([True, False]))
    with pytest.raises(ValueError, match=r"mask.*\(2,\), bool or ints; got float32\[2\]"):
        losses.per_sample(jnp.array([1.0, 4.0]), jnp.array([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"mask.*got bool\[3\]"):
        losses.per_sample(jnp.array([1.0, 4.0]), jnp.array([True, False, True]))
    # 0/1 ints are a mask: exact sums of small floats
    loss_sum, num_items = losses.per_sample(jnp.array([1.0, 4.0, 2.0]), jnp.array([1, 0, 1]))
    assert (float(loss_sum), float(num_items)) == (3.0, 2.0)
