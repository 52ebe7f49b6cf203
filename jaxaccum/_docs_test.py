"""The code of README.md and docs/data-parallel.md runs as written, and prints what they say."""

import contextlib
import io
import pathlib
import re

import pytest

from testkit import standard_numerics

pytestmark = pytest.mark.slow  # processes, or minutes of compiling: `make test` only

ROOT = pathlib.Path(__file__).resolve().parent.parent


def code_blocks(path: pathlib.Path, marker: str = "test") -> list[str]:
    """The ```python blocks of ``path`` that follow a ``<!-- marker -->`` line, in order."""
    text = path.read_text()
    return re.findall(rf"<!-- {re.escape(marker)} -->\s*```python\n(.*?)```", text, flags=re.S)


def run_blocks(blocks: list[str], name: str) -> str:
    """Runs the blocks in order in one namespace; returns what they printed."""
    namespace: dict = {}
    out = io.StringIO()
    # the documents' code is user code: it runs under JAX's default promotion rules
    with contextlib.redirect_stdout(out), standard_numerics():
        for i, block in enumerate(blocks):
            exec(compile(block, f"{name} (block {i + 1})", "exec"), namespace)
    return out.getvalue()


def test_data_parallel_doc_runs_and_prints_its_layouts():
    blocks = code_blocks(ROOT / "docs" / "data-parallel.md")
    assert len(blocks) == 10
    printed = run_blocks(blocks, "docs/data-parallel.md").splitlines()
    assert printed == [
        "updates: 2",  # 8 micro-steps, k = 4
        "mu type: float32[32@data,16]",  # ZeRO-1: the moments stay sharded
        "sum type: float32[32@data,16]",  # FSDP: the sums sharded like the parameters
        "w1 sum type: float32[2@data,8,4@model]",  # TP: a row of partial sums per "data" device
        "nnx updates: 1",
        "shard_map updates: 1",
        "saved after 2 of 4; item rows: (4,)",  # mid-window, on the host
        "resumed at micro-step 2",
        "on 2 devices: 2 rows; updates: 1",  # the window finished on the new mesh
        "checkpoints: [3, 6]",  # every 3rd micro-step, the last 2 kept
        "restored micro-step 6 on 2 devices: 2 of the window's 4 done",  # mid-window
    ]


def test_readme_jit_and_checkpoint_blocks_run():
    blocks = code_blocks(ROOT / "README.md", "test: jit") + code_blocks(
        ROOT / "README.md", "test: checkpoint"
    )
    assert len(blocks) == 2
    printed = run_blocks(blocks, "README.md (jit, checkpoint)").strip().splitlines()
    # 8 micro-steps of k = 4; then a third window saved half-way, finished on 2 devices
    assert printed[-2:] == ["updates: 2", "updates: 3"]


def test_audit_doc_nnx_recipe_runs_as_written():
    blocks = code_blocks(ROOT / "docs" / "audit.md", "test: nnx audit")
    assert len(blocks) == 1
    printed = run_blocks(blocks, "docs/audit.md (nnx audit)").strip()
    assert printed.startswith("PASSED, exact"), printed


def test_audit_doc_adam_noise_block_prints_what_it_says():
    blocks = code_blocks(ROOT / "docs" / "audit.md", "test: adam noise")
    assert len(blocks) == 1
    printed = run_blocks(blocks, "docs/audit.md (adam noise)").strip().splitlines()
    assert printed == ["gradient +3e-08: step -0.75 x lr", "gradient -2e-08: step +0.67 x lr"]


def test_migrating_doc_port_is_the_big_batch_where_optax_multi_steps_is_not():
    blocks = code_blocks(ROOT / "docs" / "migrating.md")
    assert len(blocks) == 1
    printed = run_blocks(blocks, "docs/migrating.md").splitlines()
    # the block asserts the port within float32 rounding; optax.MultiSteps' mean of means
    # is off by 0.04 on these skewed micro-batches
    assert printed[0].startswith("ported: ") and printed[0].endswith(" from the big batch")
    assert printed[1] == "optax.MultiSteps: 0.04 from it"
