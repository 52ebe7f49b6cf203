"""Two-rank launches on a busy machine: ``python -m parity_tests.stress`` (``make stress``).

A user's CI is a busy machine. This starts ``--burners`` CPU burners (processes
that spin, stopped by handle at the end), then runs ``--launches`` launches of
two gloo ranks (`torch_ref.ddp.run`, or torchrun), cycling through `KINDS`:

* ``ddp``: the reference loop (`torch_ref.train_update`, two updates of a tiny
  LM under ``DistributedDataParallel``), the ranks' records checked equal;
* ``hf_trainer``: `torch_ref.audit.audit_hf_trainer` on a tiny GPT-2 (verdict
  ``exact`` checked);
* ``trl``: `torch_ref.audit.audit_trl_grpo` (TRL's GRPOTrainer), the cuts
  ``dr_grpo`` GA 2 and ``bnpo`` GA 1 in turn;
* ``torchrun``: a parity scenario (two AdamW windows of the tiny GPT) on two
  ranks started by torchrun (`parity_tests.torch_launch`), whose ranks end
  their interpreters (``ddp.run``'s are forks that skip it), its records and
  parameters checked bitwise equal to the in-process launcher's (run once,
  before the launches).

It prints each death's error (``ddp.run``'s: the rank's traceback and every
rank's last stderr lines; torchrun's: its last lines, which name the failed
rank, its exit code or signal, and hold the rank's stderr), then the launches,
deaths and wrong answers per kind, and exits with 1 when there was any.
Example: ``python -m parity_tests.stress --launches 8 --burners 2``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

import torch_ref
from parity_tests.torch_launch import (
    TORCHRUN_ENV,
    TORCHRUN_TIMEOUT_S,
    load_result,
    save_scenario,
    torchrun_command,
)
from parity_tests.torch_ranks import run_scenario
from parity_tests.torch_scenario import AdamW, Scenario, ScenarioResult, split_window
from tinygpt.torch_gpt import TinyGPT, export_state_dict
from tinygpt.torch_testing import CONFIG, skewed_batch, tiny_gpt2
from torch_ref import ddp

KINDS = ("ddp", "hf_trainer", "trl", "torchrun")
TRL_CUTS = (("dr_grpo", 2), ("bnpo", 1))  # (loss type, GA): the cuts once seen dying under load


def _reference_rank(rank: int, world_size: int) -> list[dict]:
    """One rank: two reference updates of a tiny LM under DDP (ranks hold unequal tokens)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))
    wrapped = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    records = []
    for _ in range(2):
        ids = torch.randint(0, 32, (4, 6), generator=generator)
        labels = ids.clone()
        labels[0, 2 + rank :] = -100
        window = [{"input_ids": ids[i : i + 2], "labels": labels[i : i + 2]} for i in (0, 2)]
        records.append(torch_ref.train_update(wrapped, window, optimizer))
    return records


def _ddp(launch: int) -> None:
    ranks = ddp.run(2, _reference_rank)
    if ranks[0] != ranks[1]:
        raise AssertionError(f"the ranks recorded different windows: {ranks}")


def _hf_trainer(launch: int) -> None:
    model = tiny_gpt2(seq_len=12)
    ids = torch.randint(0, 32, (8, 12))
    labels = ids.clone()
    for row, targets in enumerate((11, 2, 7, 4, 9, 1, 5, 8)):  # cells of unequal items
        labels[row, : 12 - targets] = -100  # position 0 is never a target of the shifted loss
    rows = [{"input_ids": ids[i], "labels": labels[i]} for i in range(8)]
    report = torch_ref.audit.audit_hf_trainer(model, rows, k=2, world_size=2, progress=False)
    if report.verdict != "exact":
        raise AssertionError(f"the HF Trainer's verdict: {report.verdict}, expected exact")


def _trl(launch: int) -> None:
    loss_type, k = TRL_CUTS[(launch // len(KINDS)) % len(TRL_CUTS)]
    torch_ref.audit.audit_trl_grpo(
        loss_type, gradient_accumulation_steps=k, world_size=2, progress=False
    )


@functools.cache
def _scenario() -> tuple[Scenario, ScenarioResult]:
    """The torchrun launches' scenario and its result from the in-process launcher."""
    windows = [split_window(*skewed_batch(seed), 2, 2) for seed in range(2)]
    weights = export_state_dict(TinyGPT(CONFIG, seed=0))
    scenario = Scenario(config=CONFIG, weights=weights, windows=windows, optimizer=AdamW(1e-3))
    return scenario, run_scenario(scenario)


def _torchrun(launch: int) -> None:
    from testkit import run_bounded  # here: testkit imports JAX, and every rank imports this module

    scenario, expected = _scenario()
    with tempfile.TemporaryDirectory(prefix="stress_torchrun_") as tmp:
        files = (Path(tmp, "scenario.npz"), Path(tmp, "result.npz"))
        save_scenario(files[0], scenario)
        env = dict(os.environ, **TORCHRUN_ENV)
        cmd = torchrun_command(*files)
        returncode, out, err = run_bounded(cmd, timeout=TORCHRUN_TIMEOUT_S, env=env)
        if returncode != 0:
            last = "\n".join((out + err).splitlines()[-ddp.STDERR_LINES :])
            raise RuntimeError(f"torchrun exited with {returncode}; its last lines:\n{last}")
        result = load_result(files[1])
    # the function the in-process launcher runs, on 2 gloo ranks of one thread: bitwise equal
    if result.records != expected.records:
        raise AssertionError(f"torchrun's records {result.records} != {expected.records}")
    for got, want in zip(result.params, expected.params, strict=True):
        if any(not np.array_equal(got[name], want[name]) for name in want):
            raise AssertionError("torchrun's parameters differ from the in-process launcher's")


LAUNCHES = {"ddp": _ddp, "hf_trainer": _hf_trainer, "trl": _trl, "torchrun": _torchrun}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=50, help="two-rank launches (50)")
    parser.add_argument("--burners", type=int, default=2, help="CPU burners beside them (2)")
    args = parser.parse_args(argv)
    if args.launches > KINDS.index("torchrun"):
        _scenario()  # the torchrun launches' reference, not counted as one of them
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)
    ]
    seconds, deaths, wrong = defaultdict(list), defaultdict(int), defaultdict(int)
    try:
        for launch in range(args.launches):
            kind = KINDS[launch % len(KINDS)]
            start = time.monotonic()
            try:
                LAUNCHES[kind](launch)
                outcome = "ok"
            except AssertionError as error:
                wrong[kind] += 1
                outcome = f"WRONG: {error}"
            except (RuntimeError, TimeoutError) as error:  # a rank failed, died or hung
                deaths[kind] += 1
                outcome = f"DIED:\n{error}"
            seconds[kind].append(time.monotonic() - start)
            print(f"launch {launch + 1} {kind}: {seconds[kind][-1]:.1f} s, {outcome}", flush=True)
    finally:
        for burner in burners:  # our own two processes, by handle
            burner.kill()
            burner.wait()
    for kind, times in seconds.items():
        print(
            f"{kind}: {len(times)} launches, {deaths[kind]} deaths, {wrong[kind]} wrong;"
            f" {statistics.median(times):.1f} s median, {max(times):.1f} s max"
        )
    bad = sum(deaths.values()) + sum(wrong.values())
    print(
        f"total: {sum(map(len, seconds.values()))} launches beside {args.burners} burners,"
        f" {sum(deaths.values())} deaths, {sum(wrong.values())} wrong"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
