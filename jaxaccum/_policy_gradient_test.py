"""policy_gradient: TRL's four RL loss types as (loss_sum, num_items), hand-computed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxaccum
from jaxaccum._policy_gradient import LOSS_TYPES, policy_gradient

# Three rows: a 2-token completion (losses 1, 3), a 1-token one (loss 2) and a
# padding row whose (masked) entries are garbage, inf included.
LOSS = jnp.array([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0], [5.0, jnp.inf, 5.0]])
MASK = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", (2.0 + 2.0, 2.0)),  # sequence means 4/2 and 2/1; 2 sequences
        ("bnpo", (6.0 / 3.0, 1.0)),  # local token mean 6/3, counted as ONE unit
        ("dr_grpo", (6.0, 2.0 * 4)),  # token sum; 2 sequences x L=4
        ("dapo", (6.0, 3.0)),  # token sum; 3 valid tokens
    ],
)
def test_hand_computed_values(loss_type, expected):
    loss_sum, num_items = policy_gradient(LOSS, MASK, loss_type=loss_type, max_completion_length=4)
    # small integers and halves: exact in float32
    assert (float(loss_sum), float(num_items)) == expected
    assert loss_sum.dtype == num_items.dtype == jnp.float32


def test_gradient_weights_and_masked_inf():
    # d loss_sum / d l_it is the weight of each token: 1/n_i for grpo, 1 for dapo.
    grpo = jax.grad(lambda loss: policy_gradient(loss, MASK, loss_type="grpo")[0])(LOSS)
    dapo = jax.grad(lambda loss: policy_gradient(loss, MASK, loss_type="dapo")[0])(LOSS)
    # exact: 1/2 and 1 are representable; the inf under the mask never reaches the result
    np.testing.assert_array_equal(grpo, [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(dapo, MASK.astype(jnp.float32))


def _window(loss_type, micro_batches, L=3):
    sums = [
        policy_gradient(loss, m, loss_type=loss_type, max_completion_length=L)
        for loss, m in micro_batches
    ]
    return sum(float(s) for s, _ in sums) / sum(float(n) for _, n in sums)


def test_window_ratio_is_the_big_batch_objective_except_bnpo():
    # micro-batch 1: one 1-token completion with loss 1; micro-batch 2: one 3-token completion, losses 3.
    mb1 = (jnp.array([[1.0, 0.0, 0.0]]), jnp.array([[1, 0, 0]]))
    mb2 = (jnp.array([[3.0, 3.0, 3.0]]), jnp.array([[1, 1, 1]]))
    big = (jnp.concatenate([mb1[0], mb2[0]]), jnp.concatenate([mb1[1], mb2[1]]))
    expected_split = {"grpo": (1 + 3) / 2, "bnpo": (1 + 3) / 2, "dr_grpo": 10 / 6, "dapo": 10 / 4}
    expected_big = {"grpo": (1 + 3) / 2, "bnpo": 10 / 4, "dr_grpo": 10 / 6, "dapo": 10 / 4}
    for loss_type in LOSS_TYPES:
        # float32 sums of a few small numbers: 1e-6 relative
        assert _window(loss_type, [mb1, mb2]) == pytest.approx(expected_split[loss_type], rel=1e-6)
        assert _window(loss_type, [big]) == pytest.approx(expected_big[loss_type], rel=1e-6)
    # bnpo is the only one whose value depends on the cut: 2.0 (mean of means) vs 2.5
    assert _window("bnpo", [mb1, mb2]) != pytest.approx(_window("bnpo", [big]), rel=1e-3)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.slow  # compiles a model or a multi-device program (> 1 s): make test, not test-fast
def test_through_multi_steps(loss_type):
    # per-token loss w * l: at w = 1 the window gradient equals the window loss.
    mbs = [
        (jnp.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]), jnp.array([[1, 0, 0], [1, 1, 0]])),
        (jnp.array([[3.0, 3.0, 3.0], [9.0, 9.0, 9.0]]), jnp.array([[1, 1, 1], [0, 0, 0]])),
    ]
    tx = jaxaccum.multi_steps(optax.sgd(1.0), every_k_schedule=2)
    w = jnp.array(1.0)
    state = tx.init(w)
    for loss, m in mbs:
        fn = lambda w, loss=loss, m=m: policy_gradient(
            w * loss, m, loss_type=loss_type, max_completion_length=3
        )
        (loss_sum, num_items), grad = jax.value_and_grad(fn, has_aux=True)(w)
        updates, state = tx.update(grad, state, w, num_items=num_items, loss_sum=loss_sum)
    expected = _window(loss_type, mbs)
    # one float32 division of sums of a few small numbers: 1e-6 relative
    assert float(jaxaccum.window_metrics(state).loss) == pytest.approx(expected, rel=1e-6)
    assert float(-updates) == pytest.approx(expected, rel=1e-6)  # sgd(1): update = -gradient


def test_jit_and_batch_dims():
    # [groups, sequences, T]: the last axis is the completion, the others are rows
    loss = jnp.stack([LOSS, LOSS])
    mask = jnp.stack([MASK, MASK])
    loss_sum, num_items = jax.jit(lambda x, m: policy_gradient(x, m, loss_type="grpo"))(loss, mask)
    assert (float(loss_sum), float(num_items)) == (8.0, 4.0)  # twice the 2-D case, exact


def test_errors():
    with pytest.raises(ValueError, match="loss_type.*one of.*'grpo'.*got 'gspo'"):
        policy_gradient(LOSS, MASK, loss_type="gspo")
    with pytest.raises(ValueError, match="dr_grpo.*max_completion_length.*got None"):
        policy_gradient(LOSS, MASK, loss_type="dr_grpo")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_completion_length"):
            policy_gradient(LOSS, MASK, loss_type="dr_grpo", max_completion_length=bad)
    with pytest.raises(
        ValueError, match="3 tokens per sequence, more than max_completion_length=2"
    ):
        policy_gradient(LOSS, MASK, loss_type="dr_grpo", max_completion_length=2)
    with pytest.raises(ValueError, match=r"same shape.*\(3, 3\) and \(3, 2\)"):
        policy_gradient(LOSS, MASK[:, :2], loss_type="dapo")
    # max_completion_length is ignored by the other types (TRL configs always carry it)
    assert float(policy_gradient(LOSS, MASK, loss_type="dapo", max_completion_length=1)[1]) == 3.0
