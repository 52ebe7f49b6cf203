"""The Flax training example in quick mode, the Linen route, and the plot."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"flax_lm_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _run(main, *args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(*args) == 0
    return out.getvalue()


def test_train_quick():
    # 2 updates of the NNX tiny GPT: jaxaccum inside nnx.Optimizer vs the big batch.
    # train.main asserts the parameters agree within its fp32 TOLERANCE (2e-5) and
    # the window losses within 1e-5 relative.
    out = _run(_load("train").main, ["--quick", "--no-progress"])
    lines = [line for line in out.splitlines() if line.startswith("update ")]
    assert len(lines) == 2  # one log line per update
    for field in (
        "micro_step",
        "window_items",
        "cumulative_items",
        "loss",
        "grad_norm",
        "lr",
        "skipped",
    ):
        assert f" {field} " in lines[0]
    assert "update   2/2 | micro_step    8" in lines[1]  # k = 4 micro-steps per update


def test_linen_train_state():
    # AccumTrainState vs a plain TrainState on the big batch: within 1e-5 (asserted
    # inside), and its step counts the 5 updates, not the 20 micro-batches.
    out = _run(_load("linen_train_state").main)
    assert "AccumTrainState.step = 5 updates after 20 micro-batches" in out


def test_plot(tmp_path):
    train = _load("train")
    history = {
        "big": [5.0, 4.0],
        "jaxaccum": [5.0, 4.0],
        "multisteps": [5.0, 4.1],
        "multisteps_logged": [4.0, 3.2],
        "rel_jaxaccum": [1e-5, 3e-6],
        "rel_multisteps": [0.4, 0.2],
    }
    path = tmp_path / "curves.png"
    train.plot(history, path, train.Settings(updates=2))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
