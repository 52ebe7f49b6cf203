"""Smoke test of the benchmarks: every benchmark function on tiny sizes.

Timings are not asserted (the host is shared and noisy); the deterministic
figures are: all-reduces per window read from the compiled programs (jaxaccum
1, optax.MultiSteps with a per-micro-step pmean k; torch_ref 1, its
no_sync_backward_only bug k), the optimizer-state bytes (equal up to a few
scalars), and that between boundaries the donated step copies
no more than one parameter-sized set of arrays (the zero updates), never the
inner optimizer's state.
"""

import math

import jax
import pytest

from benchmarks import _common, _models, comm, gpu, jax_vs_torch, micro_step, report, scan, state

pytestmark = pytest.mark.slow  # processes, or minutes of compiling: `make test` only

K = 3


@pytest.fixture(scope="module")
def mlp():
    return _models.mlp(width=32, layers=3)


@pytest.fixture(scope="module")
def gpt():
    return _models.tiny_gpt(
        _models.gpt_config(d_model=16, n_layer=1, n_head=2, block_size=16), seq_len=8
    )


def test_interleaved_medians():
    calls = []
    t = _common.interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3
    )
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then rotating order
    assert set(t) == {"a", "b"} and all(len(x.walls) == 3 for x in t.values())


def test_micro_step(mlp):
    section = micro_step.run([micro_step.Case(mlp, rows=2)], k=K, rounds=1)
    results = section.data["results"]
    assert {(r["label"], r["donate"]) for r in results} == {
        (label, donate) for label in ("jaxaccum", "optax.MultiSteps") for donate in (True, False)
    }
    for r in results:
        assert r["window_wall"] > 0 and math.isfinite(r["ratio_window_cpu"])
        if r["label"] == "optax.MultiSteps":
            assert r["ratio_window_wall"] == 1.0
    ours = next(r for r in results if r["label"] == "jaxaccum" and r["donate"])
    # between boundaries: at most the zero updates (one parameter set), no inner-state copy
    assert ours["between_bytes"] <= ours["param_bytes"]
    assert "Why, from the compiled HLO" in section.body


def test_scan(mlp):
    section = scan.run(mlp, global_rows=4, ks=(1, 2, 4), rounds=1, target_k=4)
    results = {r["name"]: r for r in section.data["results"]}
    assert set(results) == {"big batch", "k=1", "k=2", "k=4"}
    assert results["big batch"]["ratio_wall"] == 1.0
    assert all(r["temp_bytes"] is None or r["temp_bytes"] >= 0 for r in results.values())


def test_all_reduces_per_window(mlp):
    results = {r["name"]: r for r in comm.jax_counts(mlp, k=K, devices=jax.devices("cpu")[:4])}
    for mapping in ("pmap", "shard_map"):
        ours = results[f"jaxaccum, {mapping}"]
        theirs = results[f"optax.MultiSteps + pmean, {mapping}"]
        assert (ours["micro_step"], ours["boundary"], ours["per_window"]) == (0, 1, 1)
        assert theirs["per_window"] == K
        # the same gradient bytes travel, k times for optax.MultiSteps
        assert theirs["bytes_per_window"] >= (K - 0.5) * ours["bytes_per_window"]
    explicit = results["jaxaccum, jit on an Explicit mesh (axis name)"]
    gspmd = results["jaxaccum, jit without axis name (GSPMD)"]
    assert (explicit["micro_step"], explicit["boundary"], explicit["per_window"]) == (0, 1, 1)
    assert gspmd["per_window"] == K  # the partitioner reduces every micro-step
    assert gspmd["bytes_per_window"] >= (K - 0.5) * explicit["bytes_per_window"]


def test_torch_ddp_all_reduces_per_window():
    results = comm.torch_counts(k=2, windows=1)
    assert [r["per_window"] for r in results] == [1, 2]


def test_state_bytes_equal_up_to_scalars(mlp, gpt):
    section = state.run([mlp, gpt], k=K)
    for r in section.data["results"]:
        assert abs(r["difference"]) <= state.SMALL_DIFFERENCE
        # both hold the inner state and one parameter-sized accumulator
        assert r["optax_bytes"] >= r["inner_bytes"] + r["param_bytes"]
    assert all(met for *_, met in section.summary)


def test_jax_vs_torch():
    config = _models.gpt_config(d_model=16, n_layer=1, n_head=2, block_size=16)
    section = jax_vs_torch.run(seq_len=8, rows=2, k=2, rounds=1, config=config)
    assert section.data["ratio"] > 0


def test_gpu_section(mlp):
    assert gpu.run("cpu").body.startswith(gpu.NOT_MEASURED)
    section = gpu.run("cpu", model=mlp, global_rows=4, k=2, rounds=1, force=True)
    assert section.data["measured"] and set(section.data["results"]) == {
        "big batch",
        "in-step scan",
        "multi_steps",
    }


def test_report_renders(mlp):
    sections = [state.run([mlp]), gpu.run("cpu")]
    text = report.render(sections, report.machine("cpu"), "python -m benchmarks", 1.0)
    assert "## Summary" in text and "not measured: no GPU in this run" in text
    assert "jax" in text and "optax" in text
