"""docs/trl-invariance.md's table is what the audit of TRL gives today, and TRL's code predicts it."""

from __future__ import annotations

import datetime

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch: no CPU build for this Python here")

from parity_tests import docs_blocks, trl_prediction, trl_table  # noqa: E402  (torch_ref)


@pytest.mark.slow
@pytest.mark.full  # 120 audits, 2 gloo ranks, about 90 s on 2 cores: `make trl-audit` runs it
def test_the_docs_table_is_the_one_the_code_produces():
    pytest.importorskip("datasets")
    pytest.importorskip("trl")
    reports = trl_table.run()
    wrong = [problem for report in reports for problem in trl_prediction.check(report)]
    assert not wrong, "\n".join(wrong)  # every verdict and weight as TRL's code predicts
    documented = docs_blocks.block(trl_table.DOC.read_text(), trl_table.BLOCK)
    assert trl_table.without_date(documented) == trl_table.without_date(
        trl_table.section(reports)
    ), "docs/trl-invariance.md is stale: run `make trl-audit`"


def test_the_block_is_replaced_between_its_markers():
    old = f"{docs_blocks.begin('t', 'by hand')}\nold\n{docs_blocks.end('t')}"
    new = f"{docs_blocks.begin('t', 'by hand')}\nnew\n{docs_blocks.end('t')}"
    replaced = docs_blocks.replace_block(f"prose\n{old}\nmore prose\n", "t", new)
    assert replaced == f"prose\n{new}\nmore prose\n"
    assert docs_blocks.block(replaced, "t") == new
    with pytest.raises(ValueError, match="document: expected the markers of the block 't'"):
        docs_blocks.replace_block("no markers", "t", new)
    dated = f"on {datetime.date(2026, 12, 2).isoformat()}: TRL"
    assert trl_table.without_date(dated) == "on DATE: TRL"


def test_the_forms_by_hand():
    # two micro-batches of 3 and 1 tokens on one rank, GA = 2, spg = 2 GA, N_gen = 10
    shape = trl_prediction.RunShape(
        tokens=np.array([2.0, 1.0, 1.0]), microbatch_tokens=np.array([3.0, 3.0, 1.0]), rows=3,
        k=2, spg=4, ranks=1, generation_tokens=10.0, max_completion_length=8, epsilon_high=5.0,
    )  # fmt: skip
    weights = {lt: trl_prediction.token_weights(lt, shape) for lt in trl_prediction.LOSS_TYPES}
    np.testing.assert_allclose(weights["grpo"], [1 / 6, 1 / 3, 1 / 3])
    np.testing.assert_allclose(weights["bnpo"], [1 / 6, 1 / 6, 1 / 2])
    np.testing.assert_allclose(weights["dr_grpo"], 1 / 24)
    np.testing.assert_allclose(weights["dapo"], 2 / 10)  # spg / (GA N_gen)
    np.testing.assert_allclose(weights["cispo"], weights["dapo"])  # min(1, 5.0) = 1
    np.testing.assert_allclose(weights["luspo"], 1 / 3)
    np.testing.assert_allclose(trl_prediction.entropy_weights(shape), weights["bnpo"])
    assert set(trl_prediction.FORMS) == {*trl_prediction.LOSS_TYPES, "entropy"}
    with pytest.raises(ValueError, match="loss_type: expected one of grpo, bnpo"):
        trl_prediction.token_weights("ppo", shape)


@pytest.mark.slow  # TRL on 2 gloo ranks, started from a script: about 20 s
def test_the_docs_example_runs_as_a_script(tmp_path):
    # as a user runs it: saved to a file, `python example.py` (the ranks import the file)
    import subprocess
    import sys

    from jaxaccum._docs_test import code_blocks

    pytest.importorskip("datasets")
    pytest.importorskip("trl")
    (block,) = code_blocks(trl_table.DOC, "test: script")
    (tmp_path / "example.py").write_text(block)
    script = subprocess.run(
        [sys.executable, str(tmp_path / "example.py")], capture_output=True, text=True,
        timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert script.returncode == 0, script.stderr[-3000:]
    assert "INVARIANT" in script.stdout and "NOT INVARIANT" not in script.stdout, script.stdout
