"""Checkpoint mid-window with Orbax, resume in a new process: bitwise the same run.

The whole training state (parameters and the ``multi_steps`` state: a
half-full window's sums, the inner AdamW state and its schedule count, the
dynamic loss scale and its growth tracker, the last window's record) is saved
with ``orbax.checkpoint`` after micro-step ``j`` and restored in a fresh
Python process against the abstract target from ``jax.eval_shape``. The
resumed run must end with exactly the bits of the uninterrupted run: the
same operations on the same values, on a deterministic CPU backend.

The 12 micro-steps (4 windows of k = 3) contain one poisoned micro-batch (its
loss multiplied by inf at micro-step 8, the second of window 3): that window
is skipped and the loss scale backs off, so the checkpoints cross a growth, a
skip and a backoff. ``j`` covers the middle of a window (5: 2 of 3
micro-batches in), a boundary (6) and a window whose sums already hold
non-finite values (8).
"""

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxaccum
from testkit import WindowSplit, skewed_windows, tiny_lm_loss, tiny_lm_params

pytestmark = pytest.mark.slow  # processes, or minutes of compiling: `make test` only

K = 3
WINDOWS = 4
MICRO_STEPS = K * WINDOWS
# 1-based: the second micro-batch of window 3 (the first micro-batch of each
# window has no valid token in this layout, and where() keeps its gradient 0)
POISONED_MICRO_STEP = 8
INTERRUPTIONS = (5, 6, 8)
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
RESUME_TIMEOUT_S = 120


def make_tx():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 2, 10)
    return jaxaccum.multi_steps(
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1),
        K,
        max_grad_norm=1.0,
        # growth after every 2 applied windows: the scale changes inside the run
        loss_scaling=jaxaccum.DynamicLossScale(init_scale=2.0**4, growth_interval=2),
    )


def micro_batches():
    """12 micro-batches of 4 samples with skewed token counts, one poisoned."""
    windows = skewed_windows(WindowSplit(1, K, 4), WINDOWS, seed=7)
    batches = []
    for w in range(WINDOWS):
        for m in range(K):
            step = w * K + m + 1
            batches.append(
                {
                    "tokens": windows["tokens"][w, 0, m],
                    "labels": windows["labels"][w, 0, m],
                    "poison": np.float32(np.inf if step == POISONED_MICRO_STEP else 1.0),
                }
            )
    return batches


def poisoned_loss(params, batch):
    loss_sum, num_items = tiny_lm_loss(params, batch)
    return loss_sum * batch["poison"], num_items


@functools.cache
def make_step():
    """One jitted step per process (compiled once, reused by every run)."""
    tx = make_tx()
    grad_fn = jaxaccum.value_and_grad(poisoned_loss)

    @jax.jit
    def step(params, state, batch):
        (loss_sum, num_items), grads = grad_fn(params, batch, loss_scale=jaxaccum.loss_scale(state))
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    return step


def initial():
    params = tiny_lm_params()
    return {"params": params, "opt_state": make_tx().init(params)}


def run(train_state, start, stop):
    """Micro-steps ``start + 1 .. stop`` (1-based) from ``train_state``."""
    step = make_step()
    params, state = train_state["params"], train_state["opt_state"]
    batches = micro_batches()
    for i in range(start, stop):
        params, state = step(params, state, batches[i])
    return {"params": params, "opt_state": state}


def save(path, train_state):
    with ocp.StandardCheckpointer() as checkpointer:  # closing waits for the write
        checkpointer.save(pathlib.Path(path).absolute(), train_state)


def restore(path):
    # the abstract target gives back the NamedTuples, dtypes and shapes
    abstract = jax.eval_shape(initial)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(pathlib.Path(path).absolute(), abstract)


def resume_main(paths):
    """Entry point of the resuming process: restore, finish the run, dump leaves."""
    for path in paths:
        train_state = restore(path)
        done = int(train_state["opt_state"].micro_step)
        final = run(train_state, done, MICRO_STEPS)
        np.savez(
            pathlib.Path(path) / "final_leaves.npz",
            *[np.asarray(leaf) for leaf in jax.tree.leaves(final)],
            resumed_at=done,
        )


def leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def uninterrupted():
    return run(initial(), 0, MICRO_STEPS)


def test_the_run_crosses_a_growth_a_skip_and_a_backoff(uninterrupted):
    metrics = jax.device_get(jaxaccum.window_metrics(uninterrupted["opt_state"]))
    # windows 1, 2 applied -> scale 2^4 -> 2^5; window 3 poisoned -> skipped,
    # 2^5 -> 2^4; window 4 applied. Exact: powers of two and integer counters.
    assert int(metrics.update_id) == 3 and int(metrics.skip_count) == 1
    assert float(metrics.loss_scale) == 2.0**4
    # the parameters moved (the run is not trivially equal to anything)
    moved = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(leaves(uninterrupted["params"]), leaves(tiny_lm_params()), strict=False)
    )
    assert moved > 1e-2


def test_state_round_trips_through_orbax_mid_window(tmp_path):
    train_state = run(initial(), 0, 5)  # window 2 holds 2 of its 3 micro-batches
    state = train_state["opt_state"]
    assert int(state.window_step) == 2 and float(state.num_items) > 0
    assert float(jnp.max(jnp.abs(state.grad_sum["proj"]))) > 0
    save(tmp_path / "ckpt", train_state)
    restored = restore(tmp_path / "ckpt")
    assert jax.tree.structure(restored) == jax.tree.structure(train_state)
    assert type(restored["opt_state"]) is jaxaccum.MultiStepsState
    assert type(restored["opt_state"].last_window) is jaxaccum.WindowMetrics
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(train_state), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)  # a checkpoint stores bits, exactly


@pytest.mark.parametrize("interrupt_after", INTERRUPTIONS)
def test_resume_in_a_new_process_is_bitwise_identical(uninterrupted, interrupt_after, resumed):
    final, resumed_at = resumed[interrupt_after]
    assert resumed_at == interrupt_after  # micro_step came back from the checkpoint
    expected = leaves(uninterrupted)
    assert len(final) == len(expected)
    for got, want in zip(final, expected, strict=False):
        # bitwise: the same jitted ops on the same values, deterministic CPU
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Checkpoints after micro-steps 5, 6, 8, all resumed by ONE new process."""
    root = tmp_path_factory.mktemp("resume")
    paths = {}
    for j in INTERRUPTIONS:
        paths[j] = root / f"after_{j}"
        train_state = run(initial(), 0, j)
        if j == POISONED_MICRO_STEP:  # the saved window sums hold the poison
            state = train_state["opt_state"]
            assert not bool(jnp.all(jnp.isfinite(state.grad_sum["proj"])))
            assert not bool(jnp.isfinite(state.loss_sum))
        save(paths[j], train_state)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    code = (
        "import sys; from jaxaccum._checkpoint_test import resume_main; resume_main(sys.argv[1:])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *[str(p) for p in paths.values()]],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RESUME_TIMEOUT_S,  # subprocess.run kills the child on timeout
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = {}
    for j, path in paths.items():
        with np.load(path / "final_leaves.npz") as data:
            names = sorted(
                (k for k in data.files if k.startswith("arr_")), key=lambda k: int(k.split("_")[1])
            )
            out[j] = ([data[k] for k in names], int(data["resumed_at"]))
    return out
