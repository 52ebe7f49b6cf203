"""Property tests (hypothesis): any split of a window gives the big-batch update.

Each example draws, for each of 2 windows of 8 samples: the sequence lengths
(all-masked samples included), its own k in 1..4, an assignment of every
sample to one of 4 devices x k micro-batches (devices and micro-batches may
be empty), and optionally one NaN/inf-poisoned (window, device, micro-batch).
Shapes never change between examples: every device sees all 8 samples of the
window in every micro-step, with the labels of the samples not assigned to it
masked. The optimizer has ``every_k_schedule=4``; a window of k < 4
micro-batches is closed by a traced ``end_window=True`` (a short window is
normalized by its real items), so both ways of closing a window are exercised
and ONE compilation serves every example.

The same examples run three times: under ``vmap`` with an axis name (every
leaf carries a device axis), under ``shard_map`` over 4 CPU devices with vma
checking on, and under plain ``jax.jit`` on an Explicit 4-device mesh (the
README's first route: the window sums are rows sharded over the devices); in
the last two the per-device gradient comes from
``jaxaccum.value_and_grad(..., axis_name=...)`` and the replicated state is
checked shard by shard. ``make fuzz`` runs the same properties with
``JAXACCUM_FUZZ_EXAMPLES`` (1000) examples per mode.

Properties, after every micro-step: the accumulated update equals the
big-batch update (a window is skipped iff it holds no token or the poison),
every device holds the same replicated state, item sums are never negative, and
the state holds no NaN/inf outside the open window's sums (which may hold the
poison until the boundary drops them).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from bigbatch import IGNORE_INDEX
from testkit import tiny_lm_loss, tiny_lm_params

pytestmark = pytest.mark.slow  # processes, or minutes of compiling: `make test` only

DEVICES = 4
SAMPLES = 8  # per window
SEQ_LEN = 8
VOCAB = 13
WINDOWS = 2
LEARNING_RATE = 0.5
MAX_EXAMPLES = int(os.environ.get("JAXACCUM_FUZZ_EXAMPLES", "40"))
# sgd: the update IS -lr x the window gradient, so this compares gradients
# directly (AdamW would map a near-zero gradient element's rounding to a
# full-size step). fp32: the big batch and the accumulation add the same
# per-token terms (at most 56 per window, each O(1)) in different orders,
# a few ulps (1.2e-7 at 1) each; two steps of lr 0.5 on parameters O(1).
PARAM_ATOL = 2e-6
# The window loss: one division of sums of the same terms, float32 ulps.
LOSS_RTOL = 1e-5

# per example: (k, skip reasons of its windows, max |param - reference|)
ran = []


K_MAX = 4


def poisoned_loss(params, batch, poison):
    loss_sum, num_items = tiny_lm_loss(params, batch)
    return loss_sum * poison, num_items  # poison is 1, nan or inf


@functools.cache
def accumulated_step(mode: str):
    """(init, step), compiled once: jit(vmap) with an axis name, jit(shard_map), or jit."""
    if mode == "jit":
        return jit_step()
    tx = jaxaccum.multi_steps(optax.sgd(LEARNING_RATE), K_MAX, axis_name="data")
    grad_fn = jaxaccum.value_and_grad(
        poisoned_loss, axis_name="data" if mode == "shard_map" else None
    )

    def step(params, state, batch, poison, end_window):
        if mode == "shard_map":  # this device's row of the batch and the poison
            batch, poison = jax.tree.map(lambda x: x[0], (batch, poison))
        (loss_sum, num_items), grads = grad_fn(params, batch, poison)
        updates, state = tx.update(
            grads, state, params, num_items=num_items, loss_sum=loss_sum, end_window=end_window
        )
        return optax.apply_updates(params, updates), state

    if mode == "vmap":
        init = jax.jit(jax.vmap(tx.init))
        return init, jax.jit(jax.vmap(step, in_axes=(0, 0, 0, 0, None), axis_name="data"))
    mesh = jax.make_mesh((DEVICES,), ("data",))
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, tiny_lm_params(vocab=VOCAB)), "data")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    rows = P("data")
    step = jax.shard_map(
        step, mesh=mesh, in_specs=(P(), specs, rows, rows, P()), out_specs=(P(), specs)
    )
    put_rows = lambda x: jax.device_put(x, NamedSharding(mesh, rows))
    jitted = jax.jit(step)
    return init, lambda params, state, batch, poison, end: jitted(
        params, state, put_rows(batch), put_rows(poison), end
    )


def jit_step():
    """Plain ``jax.jit`` on an Explicit mesh: rows split over "data", no shard_map of ours."""
    tx = jaxaccum.multi_steps(optax.sgd(LEARNING_RATE), K_MAX, axis_name="data")
    # per device the poison is this device's entry of a [devices] array
    loss_fn = lambda p, b, poison: poisoned_loss(p, b, poison.reshape(()))
    grad_fn = jaxaccum.value_and_grad(loss_fn, axis_name="data")
    mesh = jax.make_mesh((DEVICES,), ("data",))

    @jax.jit
    def step(params, state, batch, poison, end_window):
        (loss_sum, num_items), grads = grad_fn(params, batch, poison)
        updates, state = tx.update(
            grads, state, params, num_items=num_items, loss_sum=loss_sum, end_window=end_window
        )
        return optax.apply_updates(params, updates), state

    def run(params, state, batch, poison, end):
        rows = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)  # device-major
        with jax.set_mesh(mesh):
            return step(params, state, jax.device_put(rows, P("data")),
                        jax.device_put(poison, P("data")), end)  # fmt: skip

    def init(params):
        with jax.set_mesh(mesh):
            return jax.jit(tx.init)(jax.device_put(params, P()))

    return init, run


@jax.jit
def big_batch_step(params, batch):
    """The reference: one sgd step on the window's token-mean loss."""

    def mean_loss(p):
        loss_sum, num_items = tiny_lm_loss(p, batch)
        return loss_sum / jnp.maximum(num_items, 1.0), (loss_sum, num_items)

    grads, (loss_sum, num_items) = jax.grad(mean_loss, has_aux=True)(params)
    new = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return new, loss_sum / jnp.maximum(num_items, 1.0), num_items


@st.composite
def scenarios(draw):
    ks = draw(st.lists(st.integers(1, K_MAX), min_size=WINDOWS, max_size=WINDOWS))
    n = WINDOWS * SAMPLES
    # about half the samples all-masked (length 0); the rest 1..SEQ_LEN - 1 tokens
    lengths = draw(
        st.lists(st.one_of(st.just(0), st.integers(0, SEQ_LEN - 1)), min_size=n, max_size=n)
    )
    # each sample's slot: device * k + micro-batch, in its window's k
    slots = [
        draw(st.lists(st.integers(0, DEVICES * k - 1), min_size=SAMPLES, max_size=SAMPLES))
        for k in ks
    ]
    # one example in three poisons one (window, device, micro-batch)
    poison = None
    if draw(st.integers(0, 2)) == 0:
        w = draw(st.integers(0, WINDOWS - 1))
        poison = (
            w,
            draw(st.integers(0, DEVICES - 1)),
            draw(st.integers(0, ks[w] - 1)),
            draw(st.sampled_from([np.nan, np.inf])),
        )
    seed = draw(st.integers(0, 2**16))
    return ks, np.array(lengths).reshape(WINDOWS, SAMPLES), np.array(slots), poison, seed


def window_data(lengths, seed):
    """tokens and labels [windows, samples, seq]: ``n`` valid labels at 1..n."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (WINDOWS, SAMPLES, SEQ_LEN)).astype(np.int32)
    positions = np.arange(SEQ_LEN)
    valid = (positions >= 1) & (positions <= lengths[..., None])
    labels = np.where(valid, rng.integers(0, VOCAB, tokens.shape), IGNORE_INDEX)
    return tokens, labels.astype(np.int32)


def same_on_every_device(leaf, mode) -> None:
    """A replicated leaf holds one value on every device (bitwise: same ops, same psum)."""
    if mode == "vmap":  # the device axis is the leading one
        rows = list(np.asarray(leaf))
    else:  # one global array; its copies live on the devices
        rows = [np.asarray(shard.data) for shard in leaf.addressable_shards]
        assert len(rows) == DEVICES
    for row in rows[1:]:
        np.testing.assert_array_equal(row, rows[0])


def check_state(state, window_open_poisoned, mode):
    # items: never negative (exact: sums of non-negative integers)
    assert np.all(np.asarray(state.num_items) >= 0)
    assert np.all(np.asarray(state.last_window.cumulative_items) >= 0)
    assert np.all(np.asarray(state.last_window.window_items) >= 0)
    for name in ("good_windows", "loss_known", "inner_state", "last_window"):
        for leaf in jax.tree.leaves(getattr(state, name)):
            same_on_every_device(leaf, mode)
    # no NaN/inf, except in the open window's sums when it holds the poison, and
    # in the record, which says what the last window was (a poisoned one's norm)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state._replace(last_window=()))[0]:
        name = path[0].name
        if window_open_poisoned and name in ("grad_sum", "loss_sum"):
            continue
        assert np.all(np.isfinite(np.asarray(leaf))), jax.tree_util.keystr(path)


def micro_batches(tokens, labels, slot, k):
    """One window's ``k`` micro-steps: every device's rows, the samples not in its cell
    masked (``slot``: each sample's ``device * k + micro-batch``)."""
    device, micro = np.divmod(slot, k)
    for m in range(k):
        mine = (device[None, :] == np.arange(DEVICES)[:, None]) & (micro == m)
        yield {
            "tokens": np.broadcast_to(tokens, (DEVICES, SAMPLES, SEQ_LEN)),
            "labels": np.where(mine[..., None], labels, IGNORE_INDEX),
        }


def poison_factors(poison, w: int, m: int) -> np.ndarray:
    """Each device's factor on its loss in window ``w``, micro-batch ``m``: 1, or the poison."""
    factor = np.ones(DEVICES, np.float32)
    if poison is not None and poison[:3:2] == (w, m):
        factor[poison[1]] = poison[3]
    return factor


def check_window(params, state, reference, window, poisoned, mode):
    """After a window closed: the record and every device's parameters against the big batch.
    Returns the reference's parameters for the next window, the skip reason, the deviation."""
    reference_next, loss, num_items = big_batch_step(reference, window)
    metrics = jaxaccum.window_metrics(state)
    if mode == "vmap":
        metrics = jax.tree.map(lambda x: np.asarray(x)[0], metrics)
    assert float(metrics.window_items) == float(num_items)  # exact integer
    reason = 1 if num_items == 0 else (2 if poisoned else 0)
    assert int(metrics.skip_reason) == reason
    if reason == 0:
        reference = reference_next
        np.testing.assert_allclose(metrics.loss, float(loss), rtol=LOSS_RTOL)
    deviation = 0.0
    for name in reference:  # every device's copy against the reference
        ours = np.asarray(params[name], np.float64)
        expected = np.broadcast_to(reference[name], ours.shape)
        np.testing.assert_allclose(ours, expected, rtol=0, atol=PARAM_ATOL, err_msg=name)
        deviation = max(deviation, float(np.max(np.abs(ours - expected))))
    return reference, reason, deviation


def start(mode):
    """The replicated parameters (one copy per device under vmap), their state, the reference."""
    init, _ = accumulated_step(mode)
    params0 = tiny_lm_params(vocab=VOCAB)
    params = params0
    if mode == "vmap":
        params = jax.tree.map(lambda x: jnp.broadcast_to(x, (DEVICES,) + x.shape), params0)
    return params, init(params), params0


@pytest.mark.parametrize("mode", ["vmap", "shard_map", "jit"])
def test_any_split_gives_the_big_batch_update(mode, record_property):
    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(scenarios())
    def check(scenario):
        ks, lengths, slots, poison, seed = scenario
        tokens, labels = window_data(lengths, seed)
        _, step = accumulated_step(mode)
        params, state, reference = start(mode)
        reasons, deviation = [], 0.0
        for w, k in enumerate(ks):
            poisoned = poison is not None and poison[0] == w
            for m, batch in enumerate(micro_batches(tokens[w], labels[w], slots[w], k)):
                closed = m == k - 1
                factor = poison_factors(poison, w, m)
                params, state = step(params, state, batch, factor, np.bool_(closed))
                check_state(state, poisoned and not closed and poison[2] <= m, mode)
            window = {"tokens": tokens[w], "labels": labels[w]}
            reference, reason, gap = check_window(params, state, reference, window, poisoned, mode)
            reasons.append(reason)
            deviation = max(deviation, gap)
        ran.append((ks, reasons, deviation))

    ran.clear()
    check()
    ks = sorted({k for window_ks, _, _ in ran for k in window_ks})
    reasons = [r for _, rs, _ in ran for r in rs]
    deviation = max(d for _, _, d in ran)
    print(
        f"hypothesis examples run: {len(ran)}; window k values {ks}; windows applied /"
        f" empty / non-finite: {[reasons.count(r) for r in (0, 1, 2)]};"
        f" max |param - big batch|: {deviation:.3g}"
    )
    record_property("hypothesis_examples", len(ran))  # in the junit report
    # the examples really explored the space: every k, and every window outcome
    assert len(ran) >= MAX_EXAMPLES // 2
    assert ks == [1, 2, 3, 4]
    assert all(reasons.count(r) > 0 for r in (0, 1, 2))
