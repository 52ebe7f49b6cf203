"""Real multi-process DDP (gloo on 127.0.0.1): layouts, DDP bugs, communication.

All scenarios (``parity_tests.torch_scenario``) run in ONE `run_scenarios` call
(module fixture): world size 1 in this process, one launch of 2 ranks and one
of 4 ranks for everything else. Data: `tinygpt.torch_testing.skewed_batch` (valid labels 2, 47, 0, 0, 30, 1, 20,
40 per sample): in layout (4, 1) the ranks hold 49, 0, 31, 60 tokens, in
(2, 2) they hold 49 and 91, and rank 0's second micro-batch is empty.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from parity_tests.torch_ranks import run_scenarios
from parity_tests.torch_scenario import SGD, AdamW, Scenario, WarmupCosine, split_window
from tinygpt import TinyGPTConfig
from tinygpt.torch_gpt import TinyGPT, export_state_dict
from tinygpt.torch_testing import skewed_batch
from torch_ref import ddp

pytestmark = pytest.mark.slow  # real processes: 2- and 4-rank launches

CFG = TinyGPTConfig(block_size=48)
WEIGHTS = export_state_dict(TinyGPT(CFG, seed=0))
BATCHES = [skewed_batch(seed) for seed in range(3)]  # one global batch per update
LAYOUTS = [(1, 1), (1, 4), (2, 2), (4, 1)]
# Gradients of the same window under different layouts: float32 summation order
# only (~5e-7 measured); 1e-5 is 20x that and far below every bug.
GRAD_RTOL = 1e-5
# Parameters after 3 AdamW updates (lr 1e-3): ~1e-6 measured. Adam divides
# by sqrt(v): a gradient that is 0 in exact arithmetic (the attention key bias:
# softmax ignores a per-query constant) but ~1e-10 from rounding is turned
# into a layout-dependent step of ~lr * 1e-2, so 2e-5 (2% of lr) is allowed.
PARAM_ATOL = 2e-5


def _windows(world_size: int, k: int, n: int = 3) -> list:
    return [split_window(ids, labels, world_size, k) for ids, labels in BATCHES[:n]]


def _train(world_size: int, k: int, **kw) -> Scenario:
    """3 updates: AdamW + weight decay, warmup-cosine, clipping below the grad norm."""
    return Scenario(
        config=CFG, weights=WEIGHTS, windows=_windows(world_size, k),
        optimizer=AdamW(lr=1e-3, weight_decay=0.1), schedule=WarmupCosine(1, 4, init_value=1e-4),
        max_grad_norm=1.0, record_grads=True, count_comm=True, **kw,
    )  # fmt: skip


def _grad(world_size: int, k: int, **kw) -> Scenario:
    """One window, SGD lr 0: the recorded gradient is the raw window gradient."""
    return Scenario(
        config=CFG, weights=WEIGHTS, windows=_windows(world_size, k, 1), optimizer=SGD(lr=0.0),
        record_grads=True, count_comm=True, **kw,
    )  # fmt: skip


SCENARIOS: dict[str, Scenario] = {
    **{f"train_{r}x{k}": _train(r, k) for r, k in LAYOUTS},
    **{f"grad_{r}x{k}": _grad(r, k) for r, k in [(1, 1), (2, 2), (4, 1), (2, 4)]},
    "local_denominator_2x2": _grad(2, 2, bug="local_denominator"),
    "local_denominator_4x1": _grad(4, 1, bug="local_denominator"),
    "ddp_average_forgotten_2x2": _grad(2, 2, bug="ddp_average_forgotten"),
    "ddp_average_forgotten_4x1": _grad(4, 1, bug="ddp_average_forgotten"),
    "mean_of_means_2x2": _grad(2, 2, bug="mean_of_means"),
    "no_sync_backward_only_2x4": _grad(2, 4, bug="no_sync_backward_only"),
    # fp32 + GradScaler; window 1: an inf in rank 1's first micro-batch;
    # window 2: no label on any rank (skipped by request).
    "skips_2x2": Scenario(
        config=CFG,
        weights=WEIGHTS,
        windows=[
            *_windows(2, 2, 2),
            split_window(BATCHES[0][0][2:4].repeat(2, 0), BATCHES[0][1][2:4].repeat(2, 0), 2, 2),
            _windows(2, 2, 3)[2],
        ],
        grad_scaler=True,
        empty_window="skip",
        inf_microbatches=frozenset({(1, 1, 0)}),
        schedule=WarmupCosine(1, 4, init_value=1e-4),
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def results() -> dict:
    start = time.monotonic()
    out = run_scenarios(list(SCENARIOS.values()), timeout_s=240)
    results = dict(zip(SCENARIOS, out, strict=True))
    results["_seconds"] = time.monotonic() - start
    return results


def _flat(grads: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([grads[n].ravel() for n in WEIGHTS])


def _rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    fa, fb = _flat(a), _flat(b)
    return float(np.linalg.norm(fa - fb) / np.linalg.norm(fb))


def test_every_layout_gives_the_big_batch_updates(results):
    ref = results["train_1x1"]
    for r, k in LAYOUTS[1:]:
        res = results[f"train_{r}x{k}"]
        for u in range(3):
            a, b = res.records[u], ref.records[u]
            assert a["window_items"] == b["window_items"] == 140.0  # integers, exact
            assert a["cumulative_items"] == 140.0 * (u + 1)
            assert (a["micro_step"], a["update_id"], a["skipped"]) == (k * (u + 1), u + 1, False)
            assert abs(a["loss"] / b["loss"] - 1) <= 1e-6  # float32 sums of 140 terms
            assert abs(a["grad_norm"] / b["grad_norm"] - 1) <= GRAD_RTOL
            assert a["grad_norm"] > 1.0 and a["grad_norm_clipped"] == pytest.approx(
                1.0, rel=1e-6
            )  # clip active
            assert a["learning_rate"] == b["learning_rate"]  # same schedule point
            assert _rel(res.grads[u], ref.grads[u]) <= GRAD_RTOL
        dev = max(np.abs(res.params[-1][n] - ref.params[-1][n]).max() for n in WEIGHTS)
        assert dev <= PARAM_ATOL, (r, k, dev)
        # Every rank logged the same window (all values come from all-reduces).
        for rank_recs in res.rank_records:
            assert [x["loss"] for x in rank_recs] == [x["loss"] for x in res.records]


def test_correct_path_all_reduces_once_per_window(results):
    for name in ("train_2x2", "grad_2x4", "train_4x1"):
        assert [c["synced_backwards"] for c in results[name].comm] == [1] * len(
            results[name].comm
        ), name


def test_no_sync_around_backward_only_all_reduces_every_micro_batch(results):
    bug, ok = results["no_sync_backward_only_2x4"], results["grad_2x4"]
    assert bug.comm[0]["synced_backwards"] == 4  # k = 4 all-reduces instead of 1
    assert bug.comm[0]["allreduce_buckets"] == 4 * ok.comm[0]["allreduce_buckets"]
    assert _rel(bug.grads[0], ok.grads[0]) <= GRAD_RTOL  # same math, more traffic


def test_local_denominator_deviates_when_ranks_hold_different_counts(results):
    for r, k in [(2, 2), (4, 1)]:
        # Rank counts 49/91 (2x2) and 49/0/31/60 (4x1): per-rank means over-weight small ranks.
        assert (
            _rel(results[f"local_denominator_{r}x{k}"].grads[0], results[f"grad_{r}x{k}"].grads[0])
            >= 0.05
        )


def test_ddp_average_forgotten_divides_the_gradient_by_world_size(results):
    for r, k in [(2, 2), (4, 1)]:
        bug, ok = results[f"ddp_average_forgotten_{r}x{k}"], results[f"grad_{r}x{k}"]
        ratio = bug.records[0]["grad_norm"] / ok.records[0]["grad_norm"]
        assert abs(ratio * r - 1) <= 1e-6  # exactly 1/R up to float32 rounding
        assert abs(bug.records[0]["loss"] * r / ok.records[0]["loss"] - 1) <= 1e-6


def test_mean_of_means_under_ddp_deviates(results):
    assert _rel(results["mean_of_means_2x2"].grads[0], results["grad_2x2"].grads[0]) >= 0.1


def test_inf_on_one_rank_skips_the_window_on_every_rank(results):
    res = results["skips_2x2"]
    for rank_recs in res.rank_records:
        assert [x["skipped"] for x in rank_recs] == [False, True, True, False]
        assert [x["update_id"] for x in rank_recs] == [1, 1, 1, 2]
        assert [x["micro_step"] for x in rank_recs] == [2, 4, 6, 8]
        assert [x["window_items"] for x in rank_recs] == [140.0, 140.0, 0.0, 140.0]
        assert [x["cumulative_items"] for x in rank_recs] == [140.0, 140.0, 140.0, 280.0]
    lrs = [x["learning_rate"] for x in res.records]
    assert lrs[3] == lrs[1] == lrs[2]  # schedule frozen over both skips (exact)
    # Skipped windows change nothing, bitwise.
    for u in (1, 2):
        assert max(np.abs(res.params[u][n] - res.params[0][n]).max() for n in WEIGHTS) == 0.0
    assert [x["skip_reason"] for x in res.records] == [0, 2, 1, 0]  # applied, inf, empty, applied
    assert [x["skip_count"] for x in res.records] == [0, 1, 2, 2]
    # loss_scale is the scale for the NEXT window: one backoff (x0.5, exact) at the
    # inf; the empty window does not touch the scaler.
    assert [x["loss_scale"] for x in res.records] == [2.0**16, 2.0**15, 2.0**15, 2.0**15]


def test_spawn_cost_is_bounded(results):
    # Two launches (2 and 4 ranks) + 17 tiny scenarios; ~15 s measured on 2 cores.
    assert results["_seconds"] < 120


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        print("rank 1 was here", file=sys.stderr)
        raise ValueError("rank 1 fails on purpose")
    return rank


def _exit_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os.write(2, b"rank 1 leaves without a word\n")  # native code writing to fd 2
        os._exit(3)  # no exception: torch writes no error file
    return rank


def _abort_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os.abort()  # SIGABRT, as a C++ std::terminate
    return rank


def _sleep(rank: int, world_size: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def _framework_modules(rank: int, world_size: int) -> list[str]:
    return sorted({m.split(".")[0] for m in sys.modules} & {"jax", "flax", "optax", "jaxaccum"})


def test_ranks_never_see_jax():
    # Ranks are forked from a server that imported torch_ref only: torch_ref imports no JAX
    # module, and a rank inherits none from this (JAX-configured) test process.
    assert ddp.run(2, _framework_modules, timeout_s=60) == [[], []]


def test_a_rank_that_raises_reports_its_traceback_and_stderr(capfd):
    with pytest.raises(RuntimeError) as error:
        ddp.run(2, _raise_on_rank_1, timeout_s=60)
    message = str(error.value)
    assert message.startswith("torch_ref.ddp.run: rank 1 failed:")
    assert "in _raise_on_rank_1" in message and "ValueError: rank 1 fails on purpose" in message
    assert "-- rank 1's stderr (all lines) --\nrank 1 was here" in message
    assert "rank 1 was here" in capfd.readouterr().err  # the ranks' stderr, copied here


def test_a_rank_that_dies_without_an_exception_reports_its_stderr():
    with pytest.raises(RuntimeError) as error:
        ddp.run(2, _exit_on_rank_1, timeout_s=60)
    message = str(error.value)
    assert message.startswith(
        "torch_ref.ddp.run: rank 1 died: process 1 terminated with exit code 3"
    )
    assert "-- rank 1's stderr (all lines) --\nrank 1 leaves without a word" in message
    with pytest.raises(RuntimeError) as error:
        ddp.run(2, _abort_on_rank_1, timeout_s=60)
    message = str(error.value)
    assert "rank 1 died: process 1 terminated with signal SIGABRT" in message
    # faulthandler's stack of the crashed rank, in its stderr
    assert "Fatal Python error: Aborted" in message and "in _abort_on_rank_1" in message


def test_a_run_past_its_timeout_is_stopped_with_the_ranks_stacks():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        ddp.run(2, _sleep, 60.0, timeout_s=3)
    # Killed at the deadline: 3 s plus the stacks (1 s) and teardown, far below the 60 s sleep.
    assert time.monotonic() - start < 20
    message = str(error.value)
    assert message.startswith(
        "torch_ref.ddp.run: ranks [0, 1] of 2 did not finish within timeout_s=3"
    )
    for rank in (0, 1):  # where each hung rank was: its Python stack, dumped on request
        assert re.search(f"-- rank {rank}'s stderr .*\n(.*\n)*.* in _sleep", message), message
    assert ddp.run(2, _sleep, 0.0, timeout_s=60) == [0, 1]


def _rendezvous_port_is_held(rank: int, world_size: int) -> bool:
    """Whether binding the group's rendezvous port fails here (another socket holds it)."""
    with socket.socket() as s:
        try:
            s.bind((ddp.HOST, int(os.environ["MASTER_PORT"])))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


def test_no_other_job_can_take_the_rendezvous_port():
    # The launcher binds the store's port (the OS picks it) before the ranks start and holds it
    # to the end: a port picked, released and bound again later could be taken in between.
    assert ddp.run(2, _rendezvous_port_is_held, timeout_s=60) == [True, True]


def _add_rank(rank: int, world_size: int, tensor: torch.Tensor) -> torch.Tensor:
    tensor += rank + 1  # in place: on shared memory the other rank would see it
    torch.distributed.barrier()
    return tensor


def test_every_rank_gets_its_own_copy_of_the_arguments():
    tensor = torch.zeros(3)
    got = ddp.run(2, _add_rank, tensor, timeout_s=60)
    assert [t.tolist() for t in got] == [[1.0] * 3, [2.0] * 3]  # integers: exact
    assert tensor.tolist() == [0.0] * 3


# A program that launches ranks, as a user writes it (the rank's fn: a torch_ref function).
LAUNCHER = """
from torch_ref import ddp
if __name__ == "__mp_main__":  # multiprocessing imports the main module in every rank
    raise RuntimeError("this program refuses to be imported in a rank")
if __name__ == "__main__":
    ddp.run(2, ddp.one_cpu_thread, timeout_s=60)
"""


def test_a_rank_that_dies_before_fn_is_explained(tmp_path):
    # read from stdin: no file for the ranks to import; refused before any rank starts
    stdin = subprocess.run(
        [sys.executable, "-"], input=LAUNCHER, capture_output=True, text=True, timeout=120
    )
    assert "is not a file (a program read from stdin?)" in stdin.stderr, stdin.stderr
    # from a file the ranks fail to import: they die in multiprocessing, before torch_ref's code
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    script = subprocess.run(
        [sys.executable, str(tmp_path / "launcher.py")], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert "rank 0's stderr: none, it ended before torch_ref.ddp's code ran" in script.stderr
    assert "RuntimeError: this program refuses to be imported in a rank" in script.stderr


def test_a_script_that_starts_ranks_from_its_top_level_is_told_the_guard(tmp_path):
    # no `if __name__ == "__main__":`: each rank imports the script, which starts ranks again
    (tmp_path / "unguarded.py").write_text(
        "from torch_ref import ddp\nddp.run(2, ddp.one_cpu_thread, timeout_s=60)\n"
    )
    script = subprocess.run(
        [sys.executable, str(tmp_path / "unguarded.py")], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert script.returncode != 0
    assert "needs `if __name__ == '__main__':` around that code" in script.stderr, script.stderr


# A rank's last steps: a DDP run, then the records gathered (the last collective), in a fresh
# interpreter that has not imported torch._dynamo (torchrun's ranks have not). A thread joined
# stays listed in /proc until reaped: the names are read again for up to 10 s, until none is
# left (a leaked thread never leaves).
LAST_STEPS = """
import contextlib, os, time, torch
from torch_ref import ddp

def gloo_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread gone meanwhile
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
    return sorted(name for name in names if "gloo" in name)

store = torch.distributed.TCPStore(ddp.HOST, 0, 1, True)
with ddp.process_group("gloo", 60, store=store, rank=0, world_size=1):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    torch.distributed.all_gather_object([None], {"loss": 1.0})
    print(gloo_threads())
    del model  # a rank's fn has returned
deadline = time.monotonic() + 10
while gloo_threads() and time.monotonic() < deadline:
    time.sleep(0.1)
print(gloo_threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
def test_no_thread_of_the_group_outlives_process_group():
    # A gloo thread alive as the interpreter ends may free a collective's tensors then, which
    # aborts the process (torchrun's ranks did, under load): the threads are counted, not timed.
    # (testkit is not imported here: the ranks import this module, and it would bring JAX)
    cmd = [sys.executable, "-c", LAST_STEPS]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    during, after = run.stdout.splitlines()
    # the group's threads, under the names looked for (so that "none after" means something)
    assert "pt_gloo_runloop" in during, during
    assert after == "[]", run.stderr


def _uneven_streams(rank: int, world_size: int) -> str:
    """`torch_ref.train` under DDP with 5, 4 and 6 micro-batches on ranks 0, 1, 2 (k = 2):
    the third window holds 1, 0 (ran out) and 2; this rank's error, or "no error"."""
    from torch_ref import train

    model = torch.nn.parallel.DistributedDataParallel(TinyGPT(CFG, seed=0))
    ids, labels = skewed_batch(0)
    rows = [0, 1, 4, 5, 6, 7]  # those with a label (rows 2 and 3 have none)
    stream = [
        {
            "input_ids": torch.from_numpy(ids[r : r + 1]),
            "labels": torch.from_numpy(labels[r : r + 1]),
        }
        for r in rows[: (5, 4, 6)[rank]]
    ]
    try:
        train(model, stream, torch.optim.SGD(model.parameters(), lr=0.1), k=2)
    except ValueError as error:
        return str(error)
    return "no error"


def test_ranks_whose_micro_batches_run_out_unevenly_all_say_so():
    # every rank raises ours, not gloo's "Connection closed by peer" (rank 1 left) or a hang
    # (rank 0's count 1 is the mean of 1, 0, 2: the squares tell it from equal counts)
    errors = ddp.run(3, _uneven_streams, timeout_s=120)
    expected = "every rank must pass the same number of micro-batches; this rank has {}"
    for rank, count in enumerate((1, "0 (its micro-batches ran out)", 2)):
        assert expected.format(count) in errors[rank], errors
