"""Multi-host: 2 processes x 2 CPU devices (gloo) give the updates of 1 x 4.

The ``axis_name`` path of ``multi_steps`` across processes: two
``jax.distributed`` processes on 127.0.0.1, each with 2 CPU devices and gloo
collectives, train under ``shard_map`` over a global 4-device mesh, each
feeding only its own devices' data (every device a different token count,
the last one none). The reference runs the same :func:`train` in this
process on 4 of its 8 fake devices. Final parameters and every window record
must agree.
"""

import contextlib
import errno
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import jax
import numpy as np
import pytest

from testkit import multihost_worker as worker
from testkit import tiny_lm_params

pytestmark = pytest.mark.slow  # processes, or minutes of compiling: `make test` only

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 120
NUM_PROCESSES = 2
# fp32. Both runs do the same per-device work; only the all-reduce differs
# (gloo between processes vs XLA's in-process CPU all-reduce), so the window
# sums of the same 4 addends may be added in another order: a few ulps
# (~1e-7 relative) per window. AdamW maps a relative gradient error e to a
# relative update error ~e except where a gradient element nearly cancels
# (up to ~1e-3 of the step); 3 steps of lr 1e-2 bound the parameter
# difference by ~3e-5. Measured on jax 0.10.2: 7.5e-9 (not bitwise: the
# all-reduce order does differ), printed by the test.
PARAM_ATOL = 3e-5
# The window loss and norm are one sum and one division after the psum: a
# few ulps of float32.
RECORD_RTOL = 1e-6


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A port on 127.0.0.1 that this process keeps bound (not listening) until the block ends.

    Process 0 starts the coordinator on it seconds later, after importing JAX; a port picked
    and released here could be taken by another job in between (and process 1 would reach
    that job). JAX's coordinator is a gRPC server, and gRPC binds with SO_REUSEPORT: it binds
    next to this socket, while every other bind (a plain one, or another port-0 pick) is
    refused the port.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_a_reserved_port_cannot_be_taken_by_another_job():
    with reserved_port() as port, socket.socket() as other:
        with pytest.raises(OSError) as error:
            other.bind(("127.0.0.1", port))
        assert error.value.errno == errno.EADDRINUSE


def launch(tmp_path, mode) -> list[dict]:
    """Runs the 2 worker processes; kills both on failure or timeout."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    outs = [tmp_path / f"process_{i}.npz" for i in range(NUM_PROCESSES)]
    logs = [open(tmp_path / f"process_{i}.log", "w+") for i in range(NUM_PROCESSES)]
    procs = []
    with reserved_port() as port:
        try:
            for i in range(NUM_PROCESSES):
                worker_args = [str(i), str(NUM_PROCESSES), str(port), str(outs[i]), mode]
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "testkit.multihost_worker", *worker_args],
                        cwd=REPO_ROOT,
                        env=env,
                        stdout=logs[i],
                        stderr=subprocess.STDOUT,
                    )
                )
            deadline = time.monotonic() + TIMEOUT_S
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            for i, proc in enumerate(procs):
                logs[i].seek(0)
                ended = "ran past TIMEOUT_S" if proc.poll() is None else f"exit {proc.returncode}"
                assert proc.returncode == 0, f"process {i}: {ended}:\n{logs[i].read()[-4000:]}"
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            for log in logs:
                log.close()
    results = []
    for path in outs:
        with np.load(path) as data:
            results.append({key: data[key] for key in data.files})
    return results


@pytest.fixture(scope="module")
def reference():
    """One process, 4 of its 8 fake devices, shard_map: the multi-host runs' reference."""
    mesh = jax.make_mesh((worker.DEVICES,), (worker.AXIS,), devices=jax.devices()[: worker.DEVICES])
    return worker.train(mesh, worker.scenario(), "shard_map")


@pytest.mark.parametrize("mode", ["shard_map", "jit"])
def test_two_processes_give_the_single_process_updates(tmp_path, reference, mode):
    windows = worker.scenario()
    per_device = (
        (windows["labels"][..., 1:] != -100).reshape(worker.WINDOWS, worker.DEVICES, -1).sum(-1)
    )
    for counts in per_device:  # the data is as skewed as promised
        assert len(set(counts.tolist())) == worker.DEVICES and counts[-1] == 0

    results = launch(tmp_path, mode)

    # each process fed its own 2 devices of the global mesh
    assert [r["devices"].tolist() for r in results] == [[0, 1], [2, 3]]
    # both processes hold the same replicated result (one all-reduce, one answer)
    for key in results[0]:
        if key != "devices":
            np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)

    got = results[0]
    moved = max(
        float(np.max(np.abs(reference[f"params/{n}"] - np.asarray(v))))
        for n, v in tiny_lm_params().items()
    )
    assert moved > 1e-2  # the 3 updates moved the parameters
    deviation = max(
        float(np.max(np.abs(got[key].astype(np.float64) - reference[key])))
        for key in reference
        if key.startswith("params/")
    )
    print(f"multi-host vs single-process max |param difference|: {deviation:.3g}")
    assert deviation < PARAM_ATOL

    # the window records: integer counters and counts exact, floats to ulps
    for key in (
        "update_id",
        "micro_step",
        "window_items",
        "cumulative_items",
        "skipped",
        "skip_count",
    ):
        np.testing.assert_array_equal(
            got[f"metrics/{key}"], reference[f"metrics/{key}"], err_msg=key
        )
    np.testing.assert_array_equal(got["metrics/window_items"], per_device.sum(-1))
    np.testing.assert_array_equal(got["metrics/update_id"], [1, 2, 3])
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            got[f"metrics/{key}"], reference[f"metrics/{key}"], rtol=RECORD_RTOL, err_msg=key
        )


def test_nonfinite_raise_under_jit_raises_on_every_process(tmp_path):
    # the check runs on each device (a partitioned callback): run on one device only, it
    # raised on process 0 while process 1 went on and waited at its next collective
    results = launch(tmp_path, "jit_raise")
    assert [int(r["raised"]) for r in results] == [1, 1]


def test_restore_state_of_a_live_state_spanning_processes_names_the_fix(tmp_path):
    # it was JAX's "Fetching value for `jax.Array` that spans non-addressable devices"
    results = launch(tmp_path, "restore_live")
    assert [int(r["raised"]) for r in results] == [1, 1]
