"""policy_gradient and policy_token_loss: TRL's eight RL loss types, hand-computed, then
invariant under multi_steps for every cut of the window (jaxaccum.audit.audit_invariance).

TRL's own code computes the same numbers: ``_policy_gradient_trl_test.py``.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bigbatch
import jaxaccum
from jaxaccum._policy_gradient import ITEMS, LOSS_TYPES, policy_gradient
from jaxaccum._policy_token_loss import IMPORTANCE_SAMPLING_LEVELS, policy_token_loss
from testkit import audited_loops as loops
from testkit.modes import mode_for

# Three rows: a 2-token completion (losses 1, 3), a 1-token one (loss 2) and a
# padding row whose (masked) entries are garbage, inf included.
LOSS = jnp.array([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0], [5.0, jnp.inf, 5.0]])
MASK = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])

# ---- policy_gradient: the units ---------------------------------------------------------------


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", (2.0 + 2.0, 2.0)),  # sequence means 4/2 and 2/1; 2 sequences
        ("sapo", (2.0 + 2.0, 2.0)),  # grpo's unit
        ("luspo", (4.0 + 2.0, 2.0)),  # sequence sums 4 and 2; 2 sequences
        ("dr_grpo", (6.0, 2.0 * 4)),  # token sum; 2 sequences x L=4
        ("dapo", (6.0, 3.0)),  # token sum; 3 valid tokens
        ("bnpo", (6.0, 3.0)),  # its one-batch objective is the token mean: dapo's unit
        ("cispo", (6.0, 3.0)),
        ("vespo", (6.0, 3.0)),
    ],
)
def test_hand_computed_values(loss_type, expected):
    loss_sum, num_items = policy_gradient(LOSS, MASK, loss_type=loss_type, max_completion_length=4)
    # small integers and halves: exact in float32
    assert (float(loss_sum), float(num_items)) == expected
    assert loss_sum.dtype == num_items.dtype == jnp.float32


def test_every_loss_type_has_a_unit():
    counted = [t for types in ITEMS.values() for t in types]  # each type counts one item
    assert sorted(counted) == sorted(LOSS_TYPES) and len(LOSS_TYPES) == 8


def test_gradient_weights_and_masked_inf():
    # d loss_sum / d l_it is the weight of each token: 1/n_i for grpo, 1 for dapo and luspo.
    grad = lambda t: jax.grad(lambda loss: policy_gradient(loss, MASK, loss_type=t)[0])(LOSS)
    # exact: 1/2 and 1 are representable; the inf under the mask never reaches the result
    np.testing.assert_array_equal(grad("grpo"), [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0] * 3])
    np.testing.assert_array_equal(grad("dapo"), MASK.astype(jnp.float32))
    np.testing.assert_array_equal(grad("luspo"), MASK.astype(jnp.float32))


def _window(loss_type, micro_batches, L=3):
    sums = [
        policy_gradient(loss, m, loss_type=loss_type, max_completion_length=L)
        for loss, m in micro_batches
    ]
    return sum(float(s) for s, _ in sums) / sum(float(n) for _, n in sums)


def _trl_bnpo_window(micro_batches):
    """TRL's bnpo on one device: each micro-batch's LOCAL token mean, / k."""
    sums = [
        (float(jnp.sum(jnp.where(m != 0, loss, 0.0))), int(jnp.sum(m))) for loss, m in micro_batches
    ]
    means = [s / max(n, 1) for s, n in sums]
    return sum(means) / len(means)


def test_window_ratio_is_the_one_batch_objective_for_every_type():
    # micro-batch 1: a 1-token completion with loss 1; micro-batch 2: a 3-token one, losses 3
    mb1 = (jnp.array([[1.0, 0.0, 0.0]]), jnp.array([[1, 0, 0]]))
    mb2 = (jnp.array([[3.0, 3.0, 3.0]]), jnp.array([[1, 1, 1]]))
    big = (jnp.concatenate([mb1[0], mb2[0]]), jnp.concatenate([mb1[1], mb2[1]]))
    by_unit = {"grpo": (1 + 3) / 2, "luspo": (1 + 9) / 2, "dr_grpo": 10 / 6, "dapo": 10 / 4}
    for loss_type in LOSS_TYPES:
        same = {"sapo": "grpo", "bnpo": "dapo", "cispo": "dapo", "vespo": "dapo"}
        expected = by_unit[same.get(loss_type, loss_type)]
        # float32 sums of a few small numbers: 1e-6 relative
        assert _window(loss_type, [mb1, mb2]) == pytest.approx(expected, rel=1e-6)
        assert _window(loss_type, [big]) == pytest.approx(expected, rel=1e-6)
    # TRL's bnpo reduction depends on the cut: 2.0 (mean of means) vs 2.5 (one batch)
    assert _trl_bnpo_window([mb1, mb2]) == pytest.approx(2.0, rel=1e-6)
    assert _trl_bnpo_window([big]) == pytest.approx(2.5, rel=1e-6)


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
    with pytest.raises(ValueError, match="loss_type.*one of.*'grpo'.*'vespo'.*got 'gspo'"):
        policy_gradient(LOSS, MASK, loss_type="gspo")
    with pytest.raises(ValueError, match="dr_grpo.*max_completion_length.*got None"):
        policy_gradient(LOSS, MASK, loss_type="dr_grpo")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_completion_length"):
            policy_gradient(LOSS, MASK, loss_type="dr_grpo", max_completion_length=bad)
    # a padded width T = 3 above L = 2 is TRL's pad_to_multiple_of: the constant stays L
    padded = policy_gradient(LOSS, MASK, loss_type="dr_grpo", max_completion_length=2)
    assert (float(padded[0]), float(padded[1])) == (6.0, 4.0)  # 2 sequences x L = 2, exact
    with pytest.raises(ValueError, match=r"same shape.*\(3, 3\) and \(3, 2\)"):
        policy_gradient(LOSS, MASK[:, :2], loss_type="dapo")
    # max_completion_length is ignored by the other types (TRL configs always carry it)
    assert float(policy_gradient(LOSS, MASK, loss_type="dapo", max_completion_length=1)[1]) == 3.0
    with pytest.raises(ValueError, match=r"sequence_mask.*without its last axis.*\(3,\).*\(3, 3\)"):
        policy_gradient(LOSS, MASK, loss_type="grpo", sequence_mask=MASK)


@pytest.mark.parametrize(
    "loss_type, expected",
    [  # the third row masked whole, yet a completion (TRL's mask_truncated_completions)
        ("grpo", (2.0 + 2.0, 3.0)),  # it weighs 0 and counts: 3 sequences
        ("luspo", (6.0, 3.0)),
        ("dr_grpo", (6.0, 3.0 * 4)),
        ("dapo", (6.0, 3.0)),  # tokens: nothing changes
    ],
)
def test_sequence_mask_counts_a_row_masked_whole(loss_type, expected):
    every_row = jnp.array([True, True, True])
    loss_sum, num_items = policy_gradient(
        LOSS, MASK, loss_type=loss_type, max_completion_length=4, sequence_mask=every_row
    )
    assert (float(loss_sum), float(num_items)) == expected  # small integers: exact
    # a row left out of sequence_mask is padding, valid tokens and all: as if it were absent
    first_only = policy_gradient(
        LOSS, MASK, loss_type=loss_type, max_completion_length=4, sequence_mask=[1, 0, 0]
    )
    alone = policy_gradient(LOSS[:1], MASK[:1], loss_type=loss_type, max_completion_length=4)
    assert [float(x) for x in first_only] == [float(x) for x in alone]


# ---- policy_token_loss: TRL's per-token formulas ----------------------------------------------

# Two sequences of 2 tokens: ratios 2 and 1/2 (old = logps -+ log 2), advantages +1 and -1.
LOGPS = jnp.log(jnp.array([[0.5, 0.4], [0.2, 0.1]]))
OLD = LOGPS - jnp.log(jnp.array([[2.0, 2.0], [0.5, 0.5]]))
ADV = jnp.array([1.0, -1.0])
ONES = jnp.ones((2, 2), bool)
RTOL = 1e-6  # float32 exp/log of O(1) numbers, a few ulps: 1e-6 relative


def token_loss(loss_type, logps=LOGPS, **options):
    return policy_token_loss(logps, OLD, ADV, ONES, loss_type=loss_type, **options)


def test_clipped_surrogate_by_hand():
    # A > 0, r = 2: -min(2, 1.2) = -1.2; A < 0, r = 1/2: -min(-1/2, -0.8) = 0.8
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        np.testing.assert_allclose(token_loss(loss_type), [[-1.2] * 2, [0.8] * 2], rtol=RTOL)
    # epsilon_high widens the upper clip; delta caps the ratio itself (two-sided clipping)
    np.testing.assert_allclose(token_loss("dapo", epsilon_high=0.5)[0], [-1.5] * 2, rtol=RTOL)
    np.testing.assert_allclose(
        token_loss("dapo", epsilon_high=5.0, delta=1.5)[0], [-1.5] * 2, rtol=RTOL
    )
    # the clip holds the ratio constant: no gradient where it acts, -A r where it does not
    grad = jax.grad(lambda lp: jnp.sum(token_loss("dapo", lp, epsilon_high=5.0)))(LOGPS)
    np.testing.assert_allclose(grad, [[-2.0] * 2, [0.0] * 2], rtol=RTOL, atol=1e-7)


def test_cispo_sapo_vespo_by_hand():
    # cispo: -sg(min(r, eps_h)) A logp, gradient -min(r, eps_h) A
    grad = jax.grad(lambda lp: jnp.sum(token_loss("cispo", lp, epsilon_high=5.0)))(LOGPS)
    np.testing.assert_allclose(grad, [[-2.0] * 2, [0.5] * 2], rtol=RTOL)
    # sapo: -4/tau sigmoid(tau (r - 1)) A, tau = 1 for A > 0, 1.05 otherwise
    sig = lambda x: 1 / (1 + math.exp(-x))
    expected = [[-4 * sig(1.0)] * 2, [4 / 1.05 * sig(-0.5 * 1.05)] * 2]
    np.testing.assert_allclose(token_loss("sapo"), expected, rtol=RTOL)
    # vespo: phi(w) = exp(lam + k log w - lam w), w the product of the ratios (4 and 1/4)
    phi = [math.exp(3 + 2 * math.log(4) - 3 * 4), math.exp(2 + 3 * math.log(0.25) - 2 * 0.25)]
    expected = -np.array(phi)[:, None] * np.array([1.0, -1.0])[:, None] * np.asarray(LOGPS)
    np.testing.assert_allclose(token_loss("vespo"), expected, rtol=RTOL)
    grad = jax.grad(lambda lp: jnp.sum(token_loss("vespo", lp)))(LOGPS)  # phi held constant
    np.testing.assert_allclose(
        grad, -np.array(phi)[:, None] * [[1.0], [-1.0]] * np.ones((2, 2)), rtol=RTOL
    )


def test_sequence_level_importance_sampling_and_kl():
    # one ratio per sequence: exp(mean log r) over its valid tokens; row 0 has ratios 2 and 8
    logps = jnp.log(jnp.array([[0.8, 0.8]]))
    old = logps - jnp.log(jnp.array([[2.0, 8.0]]))
    seq = policy_token_loss(
        logps, old, jnp.array([1.0]), jnp.ones((1, 2)), loss_type="luspo",
        importance_sampling_level="sequence", epsilon_high=5.0,
    )  # fmt: skip
    np.testing.assert_allclose(seq, [[-4.0, -4.0]], rtol=RTOL)  # -sqrt(2 * 8) A
    # on-policy (old_logps=None: r = 1) KL: beta (e^d - d - 1), d = ref - logp = log 2
    kl = policy_token_loss(
        logps, None, jnp.array([0.0]), jnp.ones((1, 2)), loss_type="grpo", beta=0.1,
        ref_logps=logps + math.log(2.0),
    )  # fmt: skip
    np.testing.assert_allclose(kl, [[0.1 * (1 - math.log(2.0))] * 2], rtol=RTOL)


def test_masked_garbage_never_reaches_the_loss_or_its_gradient():
    logps = jnp.array([[-0.5, jnp.nan, jnp.inf], [-1.0, -jnp.inf, 1e30]])
    mask = jnp.array([[1, 0, 0], [1, 0, 0]])
    # advantages per sequence, and per token with NaN and inf under the mask: a sequence
    # ratio gathers the gradient of every token, masked ones too
    per_token = jnp.array([[1.0, jnp.nan, jnp.inf], [-1.0, jnp.nan, -jnp.inf]])
    advantages = {"sequence": jnp.array([1.0, -1.0]), "token": per_token}
    levels = IMPORTANCE_SAMPLING_LEVELS
    cases = [(t, level, a) for t in LOSS_TYPES for level in levels for a in advantages]

    def losses(lp):  # one program for every case: one compilation
        return jnp.stack([
            jnp.sum(policy_token_loss(
                lp, logps * 0.5, advantages[per], mask, loss_type=loss_type,
                importance_sampling_level=level, beta=0.04, ref_logps=logps - 1.0,
            ))
            for loss_type, level, per in cases
        ])  # fmt: skip

    values, grads = jax.jit(lambda lp: (losses(lp), jax.jacrev(losses)(lp)))(logps)
    for case, value, grad in zip(cases, values, grads, strict=True):
        assert np.isfinite(float(value)), case
        assert np.all(np.isfinite(grad)) and np.all(grad[:, 1:] == 0), case


def test_token_loss_errors():
    with pytest.raises(
        ValueError, match="policy_token_loss: `loss_type` must be one of.*got 'ppo'"
    ):
        token_loss("ppo")
    with pytest.raises(ValueError, match="importance_sampling_level.*got 'row'"):
        token_loss("grpo", importance_sampling_level="row")
    with pytest.raises(ValueError, match="beta=0.1 adds a KL term.*ref_logps="):
        token_loss("grpo", beta=0.1)
    with pytest.raises(ValueError, match=r"`logps` and `mask` and `old_logps` must have the same"):
        policy_token_loss(LOGPS, OLD[:, :1], ADV, ONES, loss_type="grpo")
    with pytest.raises(ValueError, match=r"`advantages` must be \[...\].*\(2, 2\); got \(3,\)"):
        policy_token_loss(LOGPS, OLD, jnp.ones(3), ONES, loss_type="grpo")
    # advantages per token are TRL's (B, T) form
    per_token = policy_token_loss(LOGPS, OLD, jnp.stack([ADV, ADV], 1), ONES, loss_type="dapo")
    np.testing.assert_array_equal(per_token, token_loss("dapo"))
    with pytest.raises(TypeError, match="`beta` must be a Python float.*traced"):
        jax.jit(lambda beta: token_loss("grpo", beta=beta, ref_logps=OLD))(0.04)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_bfloat16_log_probs_give_the_float32_loss_under_strict_promotion(loss_type):
    # the tests run with strict dtype promotion; bfloat16 log-probs (a bf16 model's) are
    # cast to float32 first: the loss of the same values given in float32, bit for bit
    low = LOGPS.astype(jnp.bfloat16)
    loss = policy_token_loss(low, OLD, ADV, ONES, loss_type=loss_type, beta=0.04, ref_logps=OLD)
    same = token_loss(loss_type, low.astype(jnp.float32), beta=0.04, ref_logps=OLD)
    assert loss.dtype == jnp.float32
    np.testing.assert_array_equal(loss, same)


# ---- every type is invariant under multi_steps: jaxaccum.audit.audit_invariance ---------------

T, VOCAB, DIM = 8, 5, 3
# 16 rows (a multiple of k R for every cut) of 0 to 8 completion tokens: the audit's
# layout gives the micro-batches very different token counts (at k=4 x R=2 one cell has none).
TOKENS = np.array([5, 0, 8, 1, 3, 8, 2, 6, 0, 7, 4, 1, 8, 2, 5, 3])
CUTS = [(2, 1), (4, 1), (2, 2), (4, 2)]
OPTIONS = {"luspo": {"importance_sampling_level": "sequence"}, "cispo": {"epsilon_high": 5.0}}
POLICY = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(DIM, VOCAB)), jnp.float32)}


def rl_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """A linear policy's rollouts: features, sampled token ids, old log-probs, advantages."""
    rng = np.random.default_rng(seed)
    rows = TOKENS.size
    features = rng.normal(size=(rows, T, DIM)).astype(np.float32)
    ids = rng.integers(0, VOCAB, (rows, T))
    old_w = POLICY["w"] + rng.normal(0, 0.5, (DIM, VOCAB)).astype(np.float32)  # ratios != 1
    old = np.asarray(token_logps({"w": old_w}, {"x": features, "ids": ids}))
    return {
        "x": features,
        "ids": ids.astype(np.int32),
        "old_logps": old,
        "advantages": rng.choice([-1.5, -0.5, 0.5, 1.0], rows).astype(np.float32),
        "mask": (np.arange(T) < TOKENS[:, None]).astype(np.float32),
    }


def token_logps(params, batch):
    """log pi(id_t | x_t) of a linear softmax policy (one-hot: no gather on a mesh)."""
    logits = jnp.asarray(batch["x"]) @ params["w"]
    one_hot = jax.nn.one_hot(jnp.asarray(batch["ids"]), VOCAB, dtype=logits.dtype)
    return jnp.sum(jax.nn.log_softmax(logits, axis=-1) * one_hot, axis=-1)


def rl_loss(loss_type):
    """``loss_fn(params, batch) -> (loss_sum, num_items)`` of ``loss_type``."""

    def loss_fn(params, batch):
        per_token = policy_token_loss(
            token_logps(params, batch), batch["old_logps"], batch["advantages"], batch["mask"],
            loss_type=loss_type, **OPTIONS.get(loss_type, {}),
        )  # fmt: skip
        return policy_gradient(per_token, batch["mask"], loss_type=loss_type,
                               max_completion_length=T)  # fmt: skip

    return loss_fn


def jaxaccum_loop(loss_fn, seen):
    """jaxaccum.multi_steps on the cut's R devices (``testkit``'s data-parallel micro-step)."""

    def window_fn(params, microbatches, optimizer, *, num_devices):
        k, devices = len(microbatches), num_devices
        seen.append((k, devices))
        run = loops.jaxaccum_window(loss_fn, k, mode_for(devices), devices)
        return run(params, microbatches, optimizer)

    return window_fn


def local_mean(loss_fn):
    """TRL's clamp: ``loss_sum / max(num_items, 1)``."""

    def mean(params, batch):
        loss_sum, num_items = loss_fn(params, batch)
        return loss_sum / jnp.maximum(num_items, 1.0)

    return mean


def trl_bnpo_loop(loss_fn):
    """TRL's bnpo: each rank's micro-batch token mean / k, the ranks averaged (as DDP)."""

    def window_fn(params, microbatches, optimizer, *, num_devices):
        k, devices = len(microbatches), num_devices
        cells = [
            jax.tree.map(lambda x, r=r: np.split(x, devices)[r], mb)
            for mb in microbatches
            for r in range(devices)
        ]
        grads = [jax.grad(local_mean(loss_fn))(params, cell) for cell in cells]
        grads = jax.tree.map(lambda g: g / (k * devices), loops.tree_sum(grads))
        return loops.sgd_step(params, grads, optimizer)

    return window_fn


@pytest.mark.slow  # compiles a data-parallel micro-step per cut and loss type (~5 s each)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_is_invariant_under_multi_steps(loss_type):
    batch, seen = rl_batch(), []
    loss_fn = rl_loss(loss_type)
    ratios = np.exp(np.asarray(token_logps(POLICY, batch)) - batch["old_logps"])
    ratios = ratios[batch["mask"] > 0]
    assert ratios.min() < 0.8 and ratios.max() > 1.2  # the clip (epsilon 0.2) acts both ways
    report = jaxaccum.audit.audit_invariance(
        jaxaccum_loop(loss_fn, seen), POLICY, batch, cuts=CUTS, row_items=TOKENS, progress=False
    )
    # the one-batch run, then each cut on its R devices: each twice (LR_SCALE x the rate first)
    assert seen == [cut for cut in [(1, 1), *CUTS] for _ in range(2)]
    # every cut gives the one-batch update to float32 rounding (bigbatch.INVARIANCE_RTOL, 1e-5)
    assert report.invariant, report
    assert report.tolerance == bigbatch.INVARIANCE_RTOL == 1e-5


@pytest.mark.slow  # differentiates every cell of every cut (> 1 s)
def test_trl_bnpo_reduction_is_not_invariant():
    report = jaxaccum.audit.audit_invariance(
        trl_bnpo_loop(rl_loss("dapo")), POLICY, rl_batch(), cuts=CUTS, row_items=TOKENS,
        progress=False,
    )  # fmt: skip
    # a mean of the cells' token means: the update moves by percents, far above 1e-5
    assert not report.invariant and report.worst > 1e-2, report
