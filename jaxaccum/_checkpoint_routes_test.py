"""Checkpoints on every route: Orbax and ``jax.device_get`` read the state mid-window,
a fresh process resumes bitwise, and ``restore_state`` resumes on 2 and on 8 devices.

The routes are the documented ones: one device, plain ``jax.jit`` on an Explicit
mesh with ``axis_name``, GSPMD (``jit`` without ``axis_name``), ``shard_map`` and
Flax NNX under ``nnx.jit`` on the mesh, each on 4 devices (one for the first).
The train state (parameters and the whole ``multi_steps`` state: a half-full
window's sums, AdamW's moments and schedule count, the loss scale and its
growth tracker, the last window's record) is saved with Orbax's
``StandardCheckpointer`` as users already do, without any conversion call.
"""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

import jaxaccum
from testkit import (
    WindowSplit,
    assert_trees_close,
    data_parallel,
    skewed_windows,
    tiny_lm_loss,
    tiny_lm_params,
)

pytestmark = pytest.mark.slow  # processes and five routes' compiles: `make test` only

ROUTES = ("one_device", "jit", "gspmd", "shard_map", "nnx")
DEVICES = 4
K = 3
WINDOWS = 2
MICRO_STEPS = K * WINDOWS
INTERRUPTIONS = (3, 4)  # a boundary (window 1 just applied), and 1 of 3 micro-batches in
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
RESUME_TIMEOUT_S = 300


def make_tx(axis_name, inner=None):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 1, 10)
    return jaxaccum.multi_steps(
        inner or optax.adamw(schedule, weight_decay=0.1),
        K,
        axis_name=axis_name,
        max_grad_norm=1.0,
        # growth after every applied window: the scale changes inside the run
        loss_scaling=jaxaccum.DynamicLossScale(init_scale=2.0**4, growth_interval=1),
    )


def micro_batch(route, step, devices=DEVICES):
    """Micro-step ``step`` (0-based): ``[devices, rows, seq]`` (one device: all rows)."""
    windows = skewed_windows(WindowSplit(DEVICES, K, 2), WINDOWS, seed=11)
    w, m = divmod(step, K)
    batch = {name: x[w, :, m].reshape(-1, x.shape[-1]) for name, x in windows.items()}
    devices = 1 if route == "one_device" else devices
    return {name: x.reshape(devices, -1, x.shape[-1]) for name, x in batch.items()}


# -- A route: init, step, and the state to save, the same way for every route.


def route_of(name, devices=DEVICES):
    """``(fresh, step)``: ``fresh() -> train_state``, ``step(train_state, batch)``."""
    if name == "nnx":
        return _nnx_route(devices)
    dp = data_parallel(make_tx, tiny_lm_loss, name, 1 if name == "one_device" else devices,
                       loss_scale="state")  # fmt: skip

    def fresh():
        params, state = dp.init(tiny_lm_params())
        return {"params": params, "opt_state": state}

    def step(train_state, batch):
        params, state = dp.step(train_state["params"], train_state["opt_state"], batch)
        return {"params": params, "opt_state": state}

    return fresh, step


def _nnx_route(devices):
    from flax import nnx

    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])

    class TinyLM(nnx.Module):
        def __init__(self):
            self.params = nnx.data({k: nnx.Param(v) for k, v in tiny_lm_params().items()})

    loss_fn = lambda model, batch: tiny_lm_loss({k: v[...] for k, v in model.params.items()},
                                                batch)  # fmt: skip
    graph = {}

    @nnx.jit
    def micro_step(model, optimizer, batch):
        scale = jaxaccum.loss_scale(optimizer.opt_state)
        (loss_sum, num_items), grads = jaxaccum.value_and_grad(loss_fn, axis_name="data")(
            model, batch, loss_scale=scale
        )
        optimizer.update(model, grads, num_items=num_items, loss_sum=loss_sum)

    def fresh():
        with jax.set_mesh(mesh):
            model = TinyLM()
            nnx.update(model, jax.device_put(nnx.state(model), P()))
            graph["model"], graph["optimizer"] = (
                model,
                nnx.Optimizer(model, make_tx("data"), wrt=nnx.Param),
            )
        return {"model": nnx.state(model), "optimizer": nnx.state(graph["optimizer"])}

    def step(train_state, batch):
        model, optimizer = graph["model"], graph["optimizer"]
        nnx.update(model, train_state["model"])
        nnx.update(optimizer, train_state["optimizer"])
        with jax.set_mesh(mesh):
            rows = {
                k: jax.device_put(v.reshape(-1, v.shape[-1]), P("data")) for k, v in batch.items()
            }
            micro_step(model, optimizer, rows)
        return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}

    return fresh, step


def run(name, start, stop, train_state=None, route=None):
    fresh, step = route or route_of(name)
    train_state = fresh() if train_state is None else train_state
    for i in range(start, stop):
        train_state = step(train_state, micro_batch(name, i))
    return train_state


def save(path, tree):
    with ocp.StandardCheckpointer() as checkpointer:  # closing waits for the write
        checkpointer.save(pathlib.Path(path).absolute(), tree)


def restore(path, like):
    """Against the abstract target of a fresh state: same NamedTuples and shardings."""
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(pathlib.Path(path).absolute(), target)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def resume_main(root):
    """The fresh process: for each route and checkpoint, restore, finish, dump leaves."""
    for name in ROUTES:
        route = route_of(name)
        for j in INTERRUPTIONS:
            path = pathlib.Path(root) / name / f"after_{j}"
            final = run(name, j, MICRO_STEPS, restore(path, route[0]()), route)
            np.savez(path / "final.npz", *leaves(final))


# -- Same device count: save from the run, resume in a fresh process, bitwise.


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every route's uninterrupted run, and its checkpoints after micro-steps 3 and 4."""
    root = tmp_path_factory.mktemp("routes")
    finals, mid_window = {}, {}
    for name in ROUTES:
        route = route_of(name)
        train_state = route[0]()
        for i in range(MICRO_STEPS):
            if i in INTERRUPTIONS:
                save(root / name / f"after_{i}", train_state)
            if i == 4:
                mid_window[name] = jax.device_get(train_state)  # numpy, mid-window
            train_state = route[1](train_state, micro_batch(name, i))
        finals[name] = leaves(train_state)
    return root, finals, mid_window


@pytest.fixture(scope="module")
def resumed(saved):
    root = saved[0]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    code = (
        "import sys, jax; jax.config.update('jax_num_cpu_devices', 8);"
        " from jaxaccum._checkpoint_routes_test import resume_main; resume_main(sys.argv[1])"
    )
    result = subprocess.run([sys.executable, "-c", code, str(root)], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=RESUME_TIMEOUT_S)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    out = {}
    for name in ROUTES:
        for j in INTERRUPTIONS:
            with np.load(root / name / f"after_{j}" / "final.npz") as data:
                out[name, j] = [data[f"arr_{i}"] for i in range(len(data.files))]
    return out


@pytest.mark.parametrize("name", ROUTES)
def test_device_get_reads_the_state_mid_window_with_its_open_sums(saved, name):
    paths = jax.tree_util.tree_flatten_with_path(saved[2][name])[0]
    items = [x for path, x in paths if "num_items" in jax.tree_util.keystr(path)]
    # after micro-step 4, window 2 holds 1 of its 3 micro-batches: items > 0, on the host
    assert items and all(isinstance(x, np.ndarray) for x in items)
    assert float(sum(np.sum(x) for x in items)) > 0


@pytest.mark.parametrize("j", INTERRUPTIONS)
@pytest.mark.parametrize("name", ROUTES)
def test_resume_in_a_fresh_process_is_bitwise_on_every_route(saved, resumed, name, j):
    expected = saved[1][name]
    assert len(resumed[name, j]) == len(expected)
    for got, want in zip(resumed[name, j], expected, strict=True):
        # bitwise: the same compiled ops on the same values, deterministic CPU
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_the_runs_cross_a_growth_and_move_the_parameters(saved):
    _, finals, _ = saved
    first = route_of("one_device")[0]()
    moved = max(float(np.max(np.abs(a - b))) for a, b in
                zip(finals["one_device"], leaves(first), strict=True)
                if a.dtype == np.float32 and a.shape == b.shape)  # fmt: skip
    assert moved > 1e-3  # the resumed runs are not trivially equal


# -- Another device count: restore_state, mid-window, onto 2 and onto 8 devices.

# fp32 sums of the same per-token gradients in another grouping (the saved rows
# added in float64, then the remaining micro-batches): a few ulps of O(1) window
# gradients, times SGD's lr 0.5 (measured 3e-8 to 6e-8); an R-fold item error is O(1e-1)
CROSS_ATOL = 1e-6


def cross_count_tx(axis_name):
    return jaxaccum.multi_steps(optax.sgd(0.5), 4, axis_name=axis_name)


def window_of_four(devices):
    """One window of 4 micro-batches, the same rows laid over ``devices`` devices."""
    window = skewed_windows(WindowSplit(4, 4, 2), 1, seed=5)
    return [{k: x[0, :, m].reshape(devices, -1, x.shape[-1]) for k, x in window.items()}
            for m in range(4)]  # fmt: skip


def on_host(path):
    """Orbax's restore onto one device: the saved device count need not exist here."""
    with ocp.StandardCheckpointer() as checkpointer:
        meta = checkpointer.metadata(pathlib.Path(path).absolute()).item_metadata
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), meta)
        return checkpointer.restore(pathlib.Path(path).absolute(), target)


@pytest.mark.parametrize("new_devices", [2, 8])
@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_restore_state_resumes_mid_window_on_another_device_count(tmp_path, mode, new_devices):
    old = data_parallel(cross_count_tx, tiny_lm_loss, mode, 4)
    params, state = old.init(tiny_lm_params())
    for batch in window_of_four(4)[:2]:  # 2 of 4 micro-batches, then save
        params, state = old.step(params, state, batch)
    save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    full = params, state
    for batch in window_of_four(4)[2:]:
        full = old.step(*full, batch)

    saved = on_host(tmp_path / "ckpt")
    new = data_parallel(cross_count_tx, tiny_lm_loss, mode, new_devices)
    params, like = new.init(jax.tree.map(np.asarray, saved["params"]))
    state = jaxaccum.restore_state(saved["opt_state"], like=like)
    assert int(state.window_step) == 2 and state.grad_sum["embed"].shape[0] == new_devices
    for batch in window_of_four(new_devices)[2:]:
        params, state = new.step(params, state, batch)

    record, full_record = jaxaccum.window_metrics(state), jaxaccum.window_metrics(full[1])
    assert int(record.update_id) == 1 and float(record.window_items) == float(
        full_record.window_items
    )  # counts: exact
    worst = assert_trees_close(jax.device_get(params), jax.device_get(full[0]), atol=CROSS_ATOL,
                               reason="fp32 sums regrouped over devices, SGD lr 0.5")  # fmt: skip
    print(f"{mode} resumed on {new_devices} devices: max |param - uninterrupted| = {worst:.3g}")
    window = {k: np.concatenate([b[k].reshape(-1, b[k].shape[-1]) for b in window_of_four(4)])
              for k in ("tokens", "labels")}  # fmt: skip
    loss_sum, items = tiny_lm_loss(tiny_lm_params(), window)
    grads = jax.grad(lambda p: tiny_lm_loss(p, window)[0] / items)(tiny_lm_params())
    big_batch = jax.tree.map(lambda p, g: p - 0.5 * g, tiny_lm_params(), grads)
    assert_trees_close(jax.device_get(params), big_batch, atol=CROSS_ATOL,
                       reason="fp32 big batch vs the regrouped window, SGD lr 0.5")  # fmt: skip
    assert abs(float(record.loss) - float(loss_sum / items)) < 1e-6 * float(loss_sum / items)


def test_restore_state_names_a_leaf_it_cannot_place():
    tx = cross_count_tx(None)
    params = tiny_lm_params()
    state = tx.init(params)
    bad = state._replace(
        grad_sum={"embed": np.zeros((3, 5), np.float32), "proj": state.grad_sum["proj"]}
    )
    with pytest.raises(ValueError, match=r"window sum .*grad_sum.*'embed'.* no device count"):
        jaxaccum.restore_state(jax.device_get(bad), like=state)
    with pytest.raises(ValueError, match="has no leaf"):
        jaxaccum.restore_state({"params": params}, like=state)


# AdamW (lr 3e-2, two updates) on gradients that differ in the last ulps: Adam's
# step is ~lr x sign for most elements and moves by ~lr x the relative gradient
# difference, ~1e-6 x 3e-2; elements whose gradient nearly cancels can move more
# (measured 3e-8 on 2 and on 8 devices)
NNX_CROSS_ATOL = 1e-5


@pytest.mark.parametrize("new_devices", [2, 8])
def test_nnx_train_state_resumes_mid_window_on_another_device_count(saved, tmp_path, new_devices):
    fresh, step = route_of("nnx")
    train_state = fresh()
    for i in range(4):  # window 2 holds 1 of its 3 micro-batches
        train_state = step(train_state, micro_batch("nnx", i))
    save(tmp_path / "ckpt", train_state)

    fresh, step = route_of("nnx", new_devices)
    train_state = jaxaccum.restore_state(on_host(tmp_path / "ckpt"), like=fresh())
    for i in range(4, MICRO_STEPS):
        train_state = step(train_state, micro_batch("nnx", i, new_devices))
    uninterrupted = saved[1]["nnx"][: len(jax.tree.leaves(train_state["model"]))]
    resumed_params = leaves(train_state["model"])
    worst = max(
        float(np.max(np.abs(a - b))) for a, b in zip(resumed_params, uninterrupted, strict=True)
    )
    print(f"nnx resumed on {new_devices} devices: max |param - uninterrupted| = {worst:.3g}")
    assert worst <= NNX_CROSS_ATOL


def manager_resume_main(run_dir, out):
    """A new job on 2 devices: docs/data-parallel.md's CheckpointManager restore (onto one
    device, against the checkpoint's metadata), then restore_state onto the 2-device mesh."""
    tx = cross_count_tx("data")
    on_one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.CheckpointManager(run_dir, item_handlers=ocp.StandardCheckpointHandler()) as manager:
        latest = manager.latest_step()
        shapes = manager.metadata(latest).item_metadata
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=on_one),
                              shapes)  # fmt: skip
        saved = manager.restore(latest, args=ocp.args.StandardRestore(target))
    with jax.set_mesh(jax.make_mesh((2,), ("data",))):
        params = jax.device_put(saved["params"], P())
        state = jaxaccum.restore_state(saved["opt_state"], like=tx.init(params))
    np.savez(out, window_step=state.window_step, num_items=state.num_items)


def test_a_checkpoint_manager_run_resumes_in_a_job_with_fewer_devices(tmp_path):
    # Orbax refuses a restore without a target when the saving devices are gone: the docs'
    # recipe restores onto one device; here a job of 2 devices resumes a save made on 4
    job = data_parallel(cross_count_tx, tiny_lm_loss, "jit", 4)
    params, state = job.init(tiny_lm_params())
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        for step, batch in enumerate(window_of_four(4)[:3], start=1):
            params, state = job.step(params, state, batch)
            manager.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": state}))
        manager.wait_until_finished()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    code = (
        "import sys, jax; jax.config.update('jax_num_cpu_devices', 2);"
        " from jaxaccum._checkpoint_routes_test import manager_resume_main;"
        " manager_resume_main(*sys.argv[1:])"
    )
    out = tmp_path / "resumed.npz"
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run"), str(out)],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=RESUME_TIMEOUT_S)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    with np.load(out) as resumed:
        # 3 of the window's 4 micro-batches; their items (integer counts, exact) over 2 rows
        assert int(resumed["window_step"]) == 3
        assert resumed["num_items"].shape == (2,)
        assert float(resumed["num_items"].sum()) == float(np.sum(state.num_items))
