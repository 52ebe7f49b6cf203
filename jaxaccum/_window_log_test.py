"""Logging the windows: plain numbers, each closed window once, no host sync per step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxaccum
from testkit import nnx_micro_step

K = 2


def test_window_metrics_to_python_gives_plain_numbers():
    tx = jaxaccum.multi_steps(optax.sgd(1.0), K)
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    for _ in range(K):
        _, state = tx.update({"w": jnp.ones(3)}, state, params, num_items=3, loss_sum=1.5)
    record = jaxaccum.window_metrics(state).to_python()
    # the norm of a gradient of 3 entries 2/6 = 1/3 each: sqrt(3)/3, in float32; no clip
    norm = record.pop("grad_norm")
    assert abs(norm - np.sqrt(3.0) / 3) < 1e-7 and record.pop("grad_norm_clipped") == norm
    assert record == {
        "micro_step": 2, "update_id": 1, "window_items": 6.0, "cumulative_items": 6.0,
        "loss": 0.5, "skipped": False, "skip_count": 0, "skip_reason": 0, "loss_scale": 1.0,
    }  # fmt: skip
    kinds = {name: type(value) for name, value in record.items()}
    assert kinds["update_id"] is int and kinds["skipped"] is bool and kinds["loss"] is float


def test_window_metrics_to_python_reads_a_pmap_state():
    # under pmap every state leaf holds one copy per device: the record is read once
    tx = jaxaccum.multi_steps(optax.sgd(1.0), K, axis_name="data")
    params = {"w": jnp.zeros((4, 3))}  # 4 devices' copies
    step = jax.pmap(
        lambda g, s, p: tx.update(g, s, p, num_items=3.0, loss_sum=1.5)[1],
        axis_name="data",
        devices=jax.devices()[:4],
    )
    state = jax.pmap(tx.init, devices=jax.devices()[:4])(params)
    log, logged = jaxaccum.WindowLog(), []
    for _ in range(K):
        state = step({"w": jnp.ones((4, 3))}, state, params)
        logged += log.add(state)
    logged += log.flush()
    record = jaxaccum.window_metrics(state).to_python()
    # 4 devices x K micro-batches x 3 items; loss 4 x K x 1.5 / 24
    assert (record["update_id"], record["window_items"], record["loss"]) == (1, 24.0, 0.5)
    assert logged == [record]


def test_window_metrics_to_python_refuses_copies_that_differ():
    tx = jaxaccum.multi_steps(optax.sgd(1.0), K)
    state = jax.vmap(tx.init)({"w": jnp.zeros((2, 3))})  # two lanes, one of them updated
    state = jax.tree.map(lambda x: x.at[0].set(x[0] + 1) if x.dtype == jnp.int32 else x, state)
    with pytest.raises(ValueError, match="differs between its copies"):
        jaxaccum.window_metrics(state).to_python()


def test_window_log_returns_each_closed_window_once_under_nnx_on_a_mesh():
    # 8 fake devices, plain jit, k = 2; the third window holds no item and is skipped
    mesh = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(mesh):
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        tx = jaxaccum.multi_steps(optax.adamw(1e-2), K, axis_name="data")
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        def loss_fn(model, batch):
            err = (model(batch["x"])[:, 0] - 1.0) ** 2
            return jnp.sum(batch["m"] * err), jnp.sum(batch["m"])

        micro_step = nnx_micro_step(loss_fn, axis_name="data")

        log, logged = jaxaccum.WindowLog(), []
        for step in range(5 * K):
            mask = np.full((16,), 0.0 if step // K == 2 else 1.0, np.float32)
            batch = {"x": np.full((16, 3), step, np.float32), "m": mask}
            micro_step(model, optimizer, jax.device_put(batch, P("data")))
            logged += log.add(optimizer.opt_state)
        logged += log.flush()
    assert [r["update_id"] for r in logged] == [1, 2, 2, 3, 4]
    assert [r["skip_count"] for r in logged] == [0, 0, 1, 1, 1]
    assert [r["skipped"] for r in logged] == [False, False, True, False, False]
    assert [r["window_items"] for r in logged] == [32.0, 32.0, 0.0, 32.0, 32.0]  # counted once
    assert log.flush() == []  # nothing left, nothing twice


def test_window_log_keeps_copies_a_donating_step_cannot_delete():
    # A step long enough (8 matmuls of 1500 x 1500, about a second here) that its record is
    # not ready when add() keeps it; the next step donates that state, deleting its arrays.
    # The record WindowLog kept must survive ("Array has been deleted" without its copy). On
    # a machine fast enough to finish first, the record is read at once: the test passes too.
    import functools

    tx = jaxaccum.multi_steps(optax.sgd(1e-3), 1)

    def loss_fn(params):
        h = params["w"]
        for _ in range(8):
            h = jnp.tanh(h @ params["w"])
        return jnp.sum(h), 1.0

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state):
        (loss_sum, num_items), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    params = {"w": jnp.eye(1500) * 0.5}
    params, state = step(params, tx.init(params))  # compiled
    jax.block_until_ready(state)
    log = jaxaccum.WindowLog()
    params, state = step(params, state)
    logged = log.add(state)  # the step still runs: kept, not read
    params, state = step(params, state)  # donates the state add() saw
    logged += log.add(state) + log.flush()
    assert [r["update_id"] for r in logged] == [2, 3]


def test_window_log_warns_about_windows_it_never_saw_and_skips_the_one_before_a_resume():
    import pytest

    tx = jaxaccum.multi_steps(optax.sgd(1.0), 2)
    params = {"w": jnp.zeros(2)}
    states = [tx.init(params)]
    for _ in range(6):
        states.append(tx.update({"w": jnp.ones(2)}, states[-1], params, num_items=1.0)[1])
    resumed = jaxaccum.WindowLog()  # a run resumed at micro-step 3: window 1 closed before
    logged = resumed.add(states[3]) + resumed.add(states[4]) + resumed.flush()
    assert [(r["update_id"], r["micro_step"]) for r in logged] == [(2, 4)]
    sparse = jaxaccum.WindowLog()  # add() every 4th micro-step: window 1 is never seen
    sparse.add(states[1])
    with pytest.warns(UserWarning, match=r"1 window\(s\) closed between two calls of add"):
        logged = sparse.add(states[5]) + sparse.flush()
    assert logged == []  # micro-step 5 closed no window; windows 1 and 2 were not seen
