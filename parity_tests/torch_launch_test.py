"""The standard launcher (torchrun) gives what the in-process launcher gives; the file format.

``python -m torch.distributed.run`` (torchrun) starts 2 gloo ranks on
127.0.0.1 in its own process group of the OS (``start_new_session``), bounded
by a timeout after which the whole group is killed.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch: no CPU build for this Python here")

from parity_tests.torch_launch import (  # noqa: E402
    TORCHRUN_ENV,
    TORCHRUN_TIMEOUT_S,
    load_result,
    load_scenario,
    main,
    save_result,
    save_scenario,
    torchrun_command,
)
from parity_tests.torch_ranks import run_scenario  # noqa: E402
from parity_tests.torch_scenario import AdamW, Scenario, WarmupCosine, split_window  # noqa: E402
from testkit import run_bounded  # noqa: E402
from tinygpt.torch_gpt import TinyGPT, export_state_dict  # noqa: E402
from tinygpt.torch_testing import CONFIG, skewed_batch  # noqa: E402

WEIGHTS = export_state_dict(TinyGPT(CONFIG, seed=0))


def _scenario(world_size: int, **kw) -> Scenario:
    windows = [split_window(*skewed_batch(seed), world_size, 2) for seed in range(2)]
    return Scenario(
        config=CONFIG, weights=WEIGHTS, windows=windows, optimizer=AdamW(lr=1e-3, weight_decay=0.1),
        schedule=WarmupCosine(1, 4, init_value=1e-4), max_grad_norm=1.0, record_grads=True, **kw,
    )  # fmt: skip


def _max_param_gap(a, b) -> float:
    return max(float(np.abs(x[n] - y[n]).max()) for x, y in zip(a, b, strict=True) for n in x)


def _torchrun(scenario: Path, result: Path) -> None:
    """Runs torchrun on the saved scenario; kills its whole process group on a timeout."""
    env = dict(os.environ, **TORCHRUN_ENV)
    cmd = torchrun_command(scenario, result)
    returncode, out, err = run_bounded(cmd, timeout=TORCHRUN_TIMEOUT_S, env=env)
    assert returncode == 0, out + err


@pytest.mark.slow  # torchrun and 2 ranks: ~15 s on 2 cores
def test_torchrun_gives_the_in_process_records_and_parameters(tmp_path):
    scenario = _scenario(2, count_comm=True)
    save_scenario(tmp_path / "scenario.npz", scenario)
    _torchrun(tmp_path / "scenario.npz", tmp_path / "result.npz")
    via_torchrun = load_result(tmp_path / "result.npz")
    in_process = run_scenario(scenario)
    # The same function on the same 2 gloo ranks, one intra-op thread each: the same
    # operations in the same order, so every number is bitwise equal (tolerance 0).
    assert via_torchrun.rank_records == in_process.rank_records
    assert via_torchrun.records == in_process.records
    assert _max_param_gap(via_torchrun.params, in_process.params) == 0.0
    assert _max_param_gap(via_torchrun.grads, in_process.grads) == 0.0
    assert (
        via_torchrun.comm
        == in_process.comm
        == [{"synced_backwards": 1, "allreduce_buckets": 1}] * 2
    )
    assert [r["update_id"] for r in via_torchrun.records] == [1, 2]  # both windows applied


@pytest.mark.slow  # runs a scenario (> 1 s): make test, not test-fast
def test_files_round_trip_without_a_process_group(tmp_path):
    """World size 1: ``python -m parity_tests.torch_launch`` runs in the calling process;
    NaN survives the file."""
    scenario = _scenario(1, grad_scaler=True, bug="mean_of_means", empty_window="skip",
                         inf_microbatches=frozenset({(1, 0, 1)}))  # fmt: skip
    save_scenario(tmp_path / "scenario.npz", scenario)
    loaded = load_scenario(tmp_path / "scenario.npz")
    assert [loaded.optimizer, loaded.schedule, loaded.inf_microbatches, loaded.bug] == [
        scenario.optimizer, scenario.schedule, scenario.inf_microbatches, scenario.bug,
    ]  # fmt: skip
    for u, window in enumerate(scenario.windows):  # int64 ids and labels, exactly
        for key in ("input_ids", "labels"):
            assert np.array_equal(loaded.windows[u][0][1][key], window[0][1][key])
    assert main([str(tmp_path / "scenario.npz"), str(tmp_path / "result.npz")]) == 0
    result, direct = load_result(tmp_path / "result.npz"), run_scenario(scenario)
    assert [r["skipped"] for r in result.records] == [False, True]  # the injected inf
    assert math.isnan(result.records[1]["loss"])  # written as JSON NaN, read back as NaN
    # the same run in this process twice: bitwise equal (NaN compared as NaN)
    np.testing.assert_equal(result.records, direct.records)
    assert _max_param_gap(result.params, direct.params) == 0.0
    save_result(tmp_path / "again.npz", result)
    np.testing.assert_equal(load_result(tmp_path / "again.npz").grads, result.grads)
