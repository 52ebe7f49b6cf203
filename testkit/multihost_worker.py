"""One process of the multi-host test (launched by ``jaxaccum/_multihost_test.py``).

``python -m testkit.multihost_worker PROCESS_ID NUM_PROCESSES PORT OUT.npz MODE``
joins a ``jax.distributed`` job on 127.0.0.1:PORT with 2 CPU devices per
process and gloo collectives, and trains the same scenario as the
single-process reference: ``multi_steps(axis_name='data')`` under
``shard_map`` over a global mesh of 4 devices. Each process feeds only its
own devices' data (``jax.make_array_from_process_local_data``) and writes its
view of the final parameters and window records to ``OUT.npz``.

:func:`train` is shared with the reference, which calls it in the test
process on 4 of its 8 fake devices.
"""

from __future__ import annotations

import contextlib
import sys
from functools import partial

import numpy as np

DEVICES = 4
LOCAL_DEVICES = 2
K = 2
MICRO_BATCH = 3
WINDOWS = 3
SEED = 11
AXIS = "data"


def scenario() -> dict[str, np.ndarray]:
    """``{'tokens', 'labels'}`` of shape [windows, devices, k, micro_batch, seq]."""
    from testkit import WindowSplit, skewed_windows

    return skewed_windows(WindowSplit(DEVICES, K, MICRO_BATCH), WINDOWS, seed=SEED)


def train(mesh, local_windows: dict[str, np.ndarray], mode: str) -> dict[str, np.ndarray]:
    """Trains on ``mesh``; ``local_windows`` holds this process's devices only.

    ``mode`` is ``"shard_map"`` (the step mapped over the mesh) or ``"jit"``
    (plain ``jax.jit`` under ``jax.set_mesh``, unreduced window sums).

    Returns this process's view of the final (replicated) parameters and of the
    window record after each window, as numpy arrays.
    """
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxaccum
    from testkit import tiny_lm_params

    tx = jaxaccum.multi_steps(
        optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1), K, axis_name=AXIS
    )
    replicated = NamedSharding(mesh, P())
    # replicated: every process holds the whole array
    params = jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(replicated, np.asarray(x)),
        tiny_lm_params(),
    )
    state, step, as_global = (_shard_map_step if mode == "shard_map" else _jit_step)(
        mesh, tx, params
    )
    per_device = NamedSharding(mesh, P(AXIS))
    local = lambda x: np.asarray(x.addressable_data(0))
    records, log = [], jaxaccum.WindowLog()  # each closed window's record, plain numbers
    with jax.set_mesh(mesh) if mode == "jit" else contextlib.nullcontext():
        for w in range(WINDOWS):
            for m in range(K):
                rows = jax.tree.map(lambda x, w=w, m=m: as_global(x[w, :, m]), local_windows)
                batch = jax.tree.map(
                    lambda x: jax.make_array_from_process_local_data(per_device, x), rows
                )
                params, state = step(params, state, batch)
                records += log.add(state)  # whatever is ready: never waits
    records += log.flush()
    out = {f"params/{name}": local(value) for name, value in params.items()}
    for key in records[0]:
        out[f"metrics/{key}"] = np.array([r[key] for r in records])
    return out


def nonfinite_raises(mesh, local_windows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Mode ``"jit_raise"``: ``nonfinite="raise"`` under plain ``jax.jit`` with NaN
    parameters; this process's first boundary must raise (on every process: one that did
    not would wait for the others at its next collective). Returns ``{"raised": 0/1}``."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxaccum
    from testkit import tiny_lm_params

    tx = jaxaccum.multi_steps(optax.sgd(1e-2), K, axis_name=AXIS, nonfinite="raise")
    replicated, per_device = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    nan = lambda x: jax.make_array_from_process_local_data(replicated, np.full_like(x, np.nan))
    params = jax.tree.map(nan, tiny_lm_params())
    state, step, as_global = _jit_step(mesh, tx, params)
    with jax.set_mesh(mesh):
        for m in range(K):
            rows = jax.tree.map(lambda x, m=m: as_global(x[0, :, m]), local_windows)
            batch = jax.tree.map(
                lambda x: jax.make_array_from_process_local_data(per_device, x), rows
            )
            try:
                params, state = jax.block_until_ready(step(params, state, batch))
            except jax.errors.JaxRuntimeError as error:
                return {"raised": np.array(int("nonfinite='raise'" in str(error)))}
    return {"raised": np.array(0)}


def live_state_refused(mesh) -> dict[str, np.ndarray]:
    """Mode ``"restore_live"``: ``restore_state`` of the live state, whose window sums span
    both processes' devices, is refused by name. Returns ``{"raised": 0/1}``."""
    import optax

    import jaxaccum
    from testkit import tiny_lm_params

    tx = jaxaccum.multi_steps(optax.sgd(1e-2), K, axis_name=AXIS)
    state = _jit_step(mesh, tx, tiny_lm_params())[0]
    try:
        jaxaccum.restore_state(state, like=state)
    except ValueError as error:
        return {"raised": np.array(int("spans devices of other processes" in str(error)))}
    return {"raised": np.array(0)}


def _micro_step(tx):
    """The README's micro-step on the tiny LM (``value_and_grad`` over ``AXIS``)."""
    import optax

    import jaxaccum
    from testkit import tiny_lm_loss

    grad_fn = jaxaccum.value_and_grad(tiny_lm_loss, axis_name=AXIS)

    def micro_step(params, state, batch):
        (loss_sum, num_items), grads = grad_fn(params, batch)
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    return micro_step


def _shard_map_step(mesh, tx, params):
    """``(state, step, as_global)`` of the step mapped over ``mesh`` (per-device state)."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jaxaccum

    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, params), AXIS)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    micro_step = _micro_step(tx)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(AXIS)), out_specs=(P(), specs))
    def step(params, state, batch):
        batch = jax.tree.map(lambda x: x[0], batch)  # this device's micro-batch
        return micro_step(params, state, batch)

    return state, step, lambda x: x  # [local devices, micro_batch, seq], one row per device


def _jit_step(mesh, tx, params):
    """``(state, step, as_global)`` of plain ``jax.jit`` on ``mesh`` (unreduced window sums)."""
    import jax

    step = jax.jit(_micro_step(tx))  # batch: the global micro-batch, rows over AXIS
    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(params)
    return state, step, lambda x: x.reshape(-1, x.shape[-1])  # [local rows, seq]


def main(argv: list[str]) -> None:
    process_id, num_processes, port = int(argv[0]), int(argv[1]), int(argv[2])
    out_path, mode = argv[3], argv[4]
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
    try:
        assert jax.process_count() == num_processes
        assert jax.device_count() == LOCAL_DEVICES * num_processes == DEVICES
        mesh = jax.make_mesh((DEVICES,), (AXIS,))
        # which slice of the global device axis this process feeds
        mine = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == process_id]
        windows = {name: value[:, mine] for name, value in scenario().items()}
        if mode == "jit_raise":
            out = nonfinite_raises(mesh, windows)
        elif mode == "restore_live":
            out = live_state_refused(mesh)
        else:
            out = train(mesh, windows, mode)
        out["devices"] = np.asarray(mine)
        np.savez(out_path, **out)
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
