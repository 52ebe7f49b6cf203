"""The Flax training example as its README shows it (25 updates), the Linen route, the plot."""

from __future__ import annotations

import _headlines  # examples/ is on the tests' path (pyproject.toml's pythonpath)
import pytest

pytestmark = pytest.mark.slow  # processes, or minutes of compiling: `make test` only


def test_train_25_updates():
    # The NNX tiny GPT, 25 updates: jaxaccum inside nnx.Optimizer vs the big batch and
    # optax.MultiSteps. train.main asserts the parameters agree within its fp32 TOLERANCE
    # (2e-5), the window losses within 1e-5 relative, and the mean of means far away;
    # docs_numbers_test.py checks the READMEs' figures against this run, by name.
    run = _headlines.flax_lm()
    lines = [line for line in run.output.splitlines() if line.startswith("update ")]
    assert len(lines) == int(run.exports["updates"]) == 25  # one log line per update
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
    assert "update  25/25 | micro_step  100" in lines[-1]  # k = 4 micro-steps per update


def test_linen_train_state():
    # AccumTrainState vs a plain TrainState on the big batch: within 1e-5 (asserted
    # inside), and its step counts the 5 updates, not the 20 micro-batches.
    out = _headlines.run_main(_headlines.load_flax_lm("linen_train_state").main)
    assert "AccumTrainState.step = 5 updates after 20 micro-batches" in out


def test_plot(tmp_path):
    train = _headlines.load_flax_lm("train")
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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--updates", "0"], "argument --updates: expected an int >= 1, got '0'"),
        (["--updates", "-3"], "argument --updates: expected an int >= 1, got '-3'"),
        (["--quick", "--plot", "curves.png"], "--plot needs the full run"),
    ],
)
def test_bad_flags_are_refused_before_training(argv, message, capsys):
    # they used to run 25 updates (0), crash after training nothing (-3), or skip the plot
    with pytest.raises(SystemExit) as exit_info:
        _headlines.load_flax_lm("train").main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
