"""Smoke test of the benchmarks: every benchmark function on tiny sizes.

Timings are not asserted (the host is shared and noisy). What is asserted is
what does not depend on load, each with its reason: counts and bytes read from
the compiled programs (all-reduces per window: jaxaccum 1, optax.MultiSteps
with a per-micro-step pmean k; copies between boundaries), the optimizer-state
bytes (``jax.eval_shape``), DDP's all-reduces (a communication hook), that
JAX and PyTorch trained the same model on the same windows, and that the
report's prose and tables quote the measured figures.

The benchmarks run optax's own updates (optax.MultiSteps, a bare AdamW) through
``testkit.standard``: this session is strict about dtype and rank promotion
for the project's code only (``conftest.py``).
"""

import contextlib
import json

import jax
import numpy as np
import pytest

from benchmarks import (
    _common,
    _models,
    audit_cost,
    comm,
    gpu,
    gpu_report,
    jax_vs_torch,
    micro_step,
    report,
    scan,
    state,
)
from testkit import hlo

NO_TORCH = "needs torch: no CPU build for this Python here"

pytestmark = pytest.mark.slow  # processes, or minutes of compiling: `make test` only

K = 3
WIDTH, LAYERS = 32, 3  # the MLP: LAYERS leaves, each a WIDTH x WIDTH float32 matrix
LEAF_BYTES = WIDTH * WIDTH * 4
SCALARS = 64  # bytes: "a few float32 scalars" (loss sums, item counts, counters)


@pytest.fixture(scope="module")
def mlp():
    return _models.mlp(width=WIDTH, layers=LAYERS)


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
    section = micro_step.run([micro_step.Case(mlp, rows=2)], ks=(K,), rounds=1)
    results = section.data["results"]
    assert {(r["label"], r["donate"]) for r in results} == {
        (label, donate) for label in ("jaxaccum", "optax.MultiSteps") for donate in (True, False)
    }
    for r in results:
        # the warm-up window compiles and is not measured: rounds=1 leaves one window, and
        # one count of its page faults, which the table quotes
        assert len(r["windows"]) == len(r["faults"]) == 1
        faults = r["faults"][0]
        assert f"| {faults} [{faults}-{faults}] |" in section.body
        # every counted copy is one whole parameter leaf (all leaves are the same matrix)
        for where in ("between", "boundary"):
            assert r[f"{where}_bytes"] == r[f"{where}_copies"] * LEAF_BYTES, (r["label"], where)
    ours = next(r for r in results if r["label"] == "jaxaccum" and r["donate"])
    # Between boundaries the donated step copies at most the zero updates (one parameter
    # set, 1 P), never the inner AdamW state (its two moments: 2 P, more than that bound).
    assert ours["between_bytes"] <= ours["param_bytes"] < ours["inner_bytes"]
    # the copy analysis quotes this run's counts (donated: micro-step, boundary, per window)
    in_p = lambda where: f"{ours[where + '_bytes'] / ours['param_bytes']:.1f} P"
    row = (
        f"| jaxaccum | {ours['between_copies']} ({in_p('between')}) "
        f"| {ours['boundary_copies']} ({in_p('boundary')}) | {in_p('window')} |"
    )
    assert row in section.body
    for r in results:
        # operations per window: optax.MultiSteps runs one path on every call; jaxaccum's
        # boundary runs its micro-step's operations and the loop bodies' on top (exact counts)
        ops = r["between_ops"], r["boundary_ops"], r["window_ops"]
        if r["label"] == "jaxaccum":
            assert ops[0] < ops[1] and ops[2] == (K - 1) * ops[0] + ops[1], ops
        else:
            assert ops[0] == ops[1] and ops[2] == K * ops[0], ops
    assert "\n| MLP " in section.body.split("**Operations and bytes written per window**")[1]
    _assert_bytes_written(results, section.body)
    # the temporaries table quotes each compiled program's buffer assignment
    temporaries = section.body.split("**Temporary memory**")[1]
    assert f"| yes | {ours['temp_bytes'] / ours['param_bytes']:.2f} P |" in temporaries


def _assert_bytes_written(results: list[dict], body: str) -> None:
    """What each call writes (result bytes of its operations, read from the HLO)."""
    by = {(r["label"], r["donate"]): r for r in results}
    for r in results:  # per window: k calls of one path, or k - 1 micro-steps and a boundary
        micro, boundary = r["between_written"], r["boundary_written"]
        calls = K * micro if r["label"] != "jaxaccum" else (K - 1) * micro + boundary
        assert r["window_written"] == calls, r["label"]
    ours, theirs = by[("jaxaccum", False)], by[("optax.MultiSteps", False)]
    # Not donated, both write every output afresh: the parameters, the inner state, the
    # sums or accumulator, and the gradient. They differ in scalars only (counters, the
    # loss, jaxaccum's record): less than one parameter leaf.
    assert abs(ours["between_written"] - theirs["between_written"]) < LEAF_BYTES
    # the boundary writes at least the updates (1 P) more than a micro-step
    assert ours["boundary_written"] - ours["between_written"] >= ours["param_bytes"]
    assert "writes more per window than optax.MultiSteps for every k" in body
    # Donated, a jaxaccum micro-step leaves the inner state unwritten, where an
    # optax.MultiSteps call writes it (AdamW on every call) besides the same parameters,
    # accumulator and gradient
    ours, theirs = by[("jaxaccum", True)], by[("optax.MultiSteps", True)]
    assert ours["between_written"] + ours["inner_bytes"] <= theirs["between_written"]


def test_operations_counts_what_runs():
    # a loop (its trip count read from the data) of a fused multiply-add, then an add: the
    # entry launches the loop and the add, the body its kernels (a loop that is not
    # jaxaccum's boundary: on every call, trips unknown); parameters, tuples, constants and
    # calls are bookkeeping, never counted
    def f(x):
        y = jax.lax.while_loop(lambda y: y.sum() < 100, lambda y: y * 2 + 1, x)
        return y + x

    found = hlo.operations(jax.jit(f).lower(np.ones(4, np.float32)).compile().as_text())
    ops = lambda where: sorted(o["op"] for o in found if o["where"] == where)
    assert not {"parameter", "tuple", "constant"} & {o["op"] for o in found}, found
    # XLA:CPU runs a small loop through a `call` of a computation that holds the `while`:
    # the called computation runs on the entry's path, the `call` itself launches nothing
    loops = [op for op in ops("entry") if op in ("while", "call")]
    assert loops == ["while"] and "fusion" in ops("entry"), found
    assert "fusion" in ops("repeated") and ops("loop") == [], found
    assert {o["trips"] for o in found if o["where"] == "repeated"} == {None}, found
    # what each writes: a fused kernel its f32[4] result (16 bytes); the loop, nothing of its
    # own (its body's kernels write)
    assert all(o["bytes"] == 16 for o in found if o["op"] == "fusion"), found
    assert all(o["bytes"] == 0 for o in found if o["op"] in ("while", "call")), found


def test_scan(mlp):
    # 64 rows: the activations (rows x WIDTH float32 per layer) outweigh the scan's carry
    section = scan.run(mlp, global_rows=64, ks=(1, 2, 4), rounds=1, target_k=4)
    results = {r["name"]: r for r in section.data["results"]}
    assert set(results) == {"big batch", "k=1", "k=2", "k=4"}
    temp = {name: r["temp_bytes"] for name, r in results.items()}
    assert all(isinstance(b, int) for b in temp.values()), temp  # CPU reports memory analysis
    # k=2 and k=4 are the same scan with half the rows per micro-batch: half the live
    # activations, the same carry (one gradient sum); so is the big batch against k=4
    # (exact: the compiled programs' temporary sizes, no timing)
    assert temp["k=4"] < temp["k=2"] and temp["k=4"] < temp["big batch"], temp
    assert [s[0] for s in section.summary] == [
        "in-step scan / big batch, time, k=4 (CPU time)",
        "in-step scan / big batch, temporary memory, k=4",
    ]


def test_all_reduces_per_window(mlp):
    results = {r["name"]: r for r in comm.jax_counts(mlp, k=K, devices=jax.devices("cpu")[:4])}
    grad_bytes = _common.tree_bytes(mlp.params)  # one float32 gradient
    # data parallelism needs no collective but all-reduces: no permute, gather or scatter
    # on any program (a regression that adds one cannot hide behind the all-reduce count)
    assert {name: r["other_per_window"] for name, r in results.items()} == dict.fromkeys(
        results, 0
    ), results
    for mapping in ("pmap", "shard_map"):
        ours = results[f"jaxaccum, {mapping}"]
        theirs = results[f"optax.MultiSteps + pmean, {mapping}"]
        assert (ours["micro_step"], ours["boundary"], ours["per_window"]) == (0, 1, 1)
        assert (theirs["micro_step"], theirs["boundary"], theirs["per_window"]) == (1, 1, K)
        # optax.MultiSteps all-reduces exactly the pmean-ed gradient on every micro-step
        assert theirs["bytes_per_window"] == K * grad_bytes
        # jaxaccum: the gradient once, with the window's loss sum and items in the same one
        assert 0 <= ours["bytes_per_window"] - grad_bytes <= SCALARS, ours
    explicit = results["jaxaccum, jit on an Explicit mesh (axis name)"]
    gspmd = results["jaxaccum, jit without axis name (GSPMD)"]
    assert (explicit["micro_step"], explicit["boundary"], explicit["per_window"]) == (0, 1, 1)
    assert 0 <= explicit["bytes_per_window"] - grad_bytes <= SCALARS, explicit
    assert gspmd["per_window"] == K  # the partitioner reduces every micro-step
    # each time the gradient, and at most a few scalars with it
    assert 0 <= gspmd["bytes_per_window"] - K * grad_bytes <= K * SCALARS, gspmd


def test_torch_ddp_all_reduces_per_window():
    pytest.importorskip("torch", reason=NO_TORCH)
    results = comm.torch_counts(k=2, windows=1)
    assert [r["per_window"] for r in results] == [1, 2]
    # torch_ref syncs the last backward only; the bug syncs every one (no_sync wraps backward
    # but not forward, so DDP's reducer still fires)
    assert [r["synced_backwards"] for r in results] == [1, 2]


def test_state_bytes_equal_up_to_scalars(mlp, gpt):
    section = state.run([mlp, gpt], k=K)
    for r in section.data["results"]:
        # both hold the inner state and one parameter-sized float32 accumulator; the rest is
        # scalars, SMALL_DIFFERENCE bytes at most (a few dozen 4-byte counters and records)
        for wrapper in ("jaxaccum", "optax"):
            rest = r[f"{wrapper}_bytes"] - r["inner_bytes"] - r["param_bytes"]
            assert 0 <= rest <= state.SMALL_DIFFERENCE, (r["model"], wrapper, rest)
        assert abs(r["difference"]) <= state.SMALL_DIFFERENCE
    assert all(met for *_, met in section.summary)


def test_jax_vs_torch():
    pytest.importorskip("torch", reason=NO_TORCH)
    config = _models.gpt_config(d_model=16, n_layer=1, n_head=2, block_size=16)
    section = jax_vs_torch.run(seq_len=8, rows=2, k=2, rounds=1, config=config)
    trained = section.data["trained"]
    # the warm-up window and one round: two updates in each framework
    assert trained["jax"]["update_id"] == trained["torch"]["update_id"] == 2
    # the same weights, windows and AdamW: the last window's mean loss agrees up to float32
    # rounding (different summation orders over 32 tokens, after one AdamW step of 1e-4)
    np.testing.assert_allclose(trained["jax"]["loss"], trained["torch"]["loss"], rtol=1e-5)


def test_gpu_section(mlp):
    assert gpu.run("cpu").body.startswith(gpu.NOT_MEASURED)
    section = gpu.run("cpu", model=mlp, global_rows=4, k=2, rounds=1, force=True)
    assert section.data["measured"] and set(section.data["results"]) == {
        "big batch",
        "in-step scan",
        "multi_steps",
        "optax.MultiSteps",
        gpu.FLOOR,
        *gpu.EXPERIMENTS.values(),
    }
    assert section.summary[-1][1] == f"{section.data['per_window_vs_optax']:.3f}"
    assert gpu.jax_vs_torch("cpu") is None  # section 6b: on a GPU only
    overheads = {name: r["overhead"] for name, r in section.data["results"].items()}
    assert [measured for _, measured, _, _ in section.summary[:2]] == [
        f"{overheads[n]:+.1%}" for n in ("in-step scan", "multi_steps")
    ]


def test_boundary_experiments_compute_the_loops_update(mlp):
    # section 6's experiment: the boundary as a select or a cond instead of the while loops.
    # One window of k = 2: the same parameters, up to float32 rounding (another fusion)
    params, loops = {}, {}
    for kind in ("loop", *gpu.EXPERIMENTS):
        with gpu.boundary_as(kind) if kind != "loop" else contextlib.nullcontext():
            variant = micro_step.build(mlp, "jaxaccum", "adamw", True, 2, 4)
        params[kind] = jax.device_get(gpu.dispatched(variant)())
        loops[kind] = (variant.hlo.count(" while("), variant.hlo.count(" conditional("))
    assert loops == {"loop": (2, 0), "select": (0, 0), "cond": (0, 2)}  # the forms compiled
    for kind in gpu.EXPERIMENTS:
        for a, b in zip(
            jax.tree.leaves(params["loop"]), jax.tree.leaves(params[kind]), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_gpu_section_quotes_the_recorded_gpu_run():
    # without a GPU, section 6 quotes docs/benchmarks-gpu.md, the last GPU run's section
    body = gpu.run("cpu").body
    assert body.startswith(gpu.NOT_MEASURED) and "### 6. GPU" in body and "### 6b. GPU" in body
    rows = gpu_report.section_rows(gpu.RECORD.read_text(), "## 6. GPU")
    assert list(rows) == ["big batch", "in-step scan", "multi_steps", "optax.MultiSteps", gpu.FLOOR]
    assert all(f"| {name} | {' | '.join(cells)} |" in body for name, cells in rows.items())


def test_gpu_page_is_written_from_the_gpu_run_records():
    # docs/parity-gpu.md: every number read from docs/gpu-run/ (python -m benchmarks.gpu_report)
    assert gpu_report.render() == gpu_report.PAGE.read_text()
    assert "**PASS: 12/12 checks within tolerance, 9/9 known bugs flagged**" in gpu_report.render()


def test_report_renders(mlp):
    sections = [state.run([mlp]), gpu.run("cpu")]
    text = report.render(sections, report.machine("cpu"), "python -m benchmarks", 1.0)
    assert "not measured: no GPU in this run" in text
    # the summary table: a header, its rule, and one row per figure of every section
    summary = text.split("## Summary\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert len(summary) == 2 + sum(len(s.summary) for s in sections)
    assert [line.split(" | ")[0] for line in summary[2:]] == [
        "| " + figure for s in sections for figure, *_ in s.summary
    ]
    for s in sections:
        assert text.count(f"\n## {s.title}\n") == 1


def test_the_audit_cost_block_of_the_docs_is_its_record():
    # docs/audit.md's cost table is rendered from docs/audit-cost.json (make audit-gpt2 and
    # make bench measure it): the block must be that rendering, number for number
    from parity_tests import docs_blocks

    documented = docs_blocks.block((audit_cost.DOCS / "audit.md").read_text(), audit_cost.BLOCK)
    assert documented == audit_cost.recorded_block(), "run `make audit-gpt2` (or write_block)"


def test_the_audit_cost_rows_are_within_budget_in_the_record():
    # the one-device audits up to GPT-2 small: at most 4 x the model's float32 bytes + 1.5 GB
    recorded = json.loads(audit_cost.RECORD.read_text())["audits"]
    for key, result in recorded.items():
        budget = audit_cost.budget_bytes(result["params"])
        assert result["peak_bytes"] <= budget, f"{key}: {result['peak_bytes']:.3g} > {budget:.3g}"
        assert result["seconds"] <= audit_cost.BUDGET_S, key
