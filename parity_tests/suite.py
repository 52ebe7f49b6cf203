"""The parity suite: which runs each scenario gets, through what, and which comparisons decide.

The flow, top down: :func:`run_suite` turns the matrix into prepared cases once
(``parity_tests.cases.plan``: the dtypes and arrays of every scenario and
big batch), hands those cases to the torch runs (``run_torch``, one launch per
world size) and the JAX runs (``run_jax``), then compares the runs
(:func:`build_checks`, ``parity_tests.compare``) into a
``parity_tests.compare.SuiteResult``, which the report reads.

For every scenario (a window layout of the default skewed data):

    jaxaccum  vs torch_ref          the two implementations, same layout
    jaxaccum  vs jax big batch      layout invariance in JAX (plain optax.adamw reference)
    torch_ref vs torch big batch    layout invariance in torch (R = k = 1 reference)
    jaxaccum  vs torch big batch    the layout against the other framework's big batch
    jax big batch vs torch big batch  (once per distinct big batch; the quick
                                       matrix: the control scenario's only)

and on the control scenario (R=2, k=2, token unit, the short window, clipping
and warmup-cosine active, so that every bug has something to act on):

    optax.MultiSteps (per-micro-batch means) vs jax big batch     must be FLAGGED
    torch_ref.buggy.<each bug>               vs torch big batch   must be FLAGGED
        (but the two that change nothing until a window is skipped: below)
    no_sync_backward_only: gradient all-reduces per window vs torch_ref (same
    numbers by design; the bug is k x the communication)

and on the loss-scaling scenario (:func:`scaling_scenario`: the control scenario
with fp16 dynamic loss scaling, fp32 compute, an inf injected into one
micro-batch of one rank in window 3, the same way on both sides):

    jaxaccum  vs torch_ref          the same windows skipped, the same loss-scale and
                                    update_id sequences (exactly), parameters within fp32
    optax.MultiSteps (no skip) vs jaxaccum   must be FLAGGED: the inf reaches its state
    torch_ref.buggy.skip_per_microbatch, scheduler_per_window  vs torch_ref  must be FLAGGED
        (``Variant.overflow_only``: window 3 is applied without the inf's micro-batch; the
        LR schedule moves on window 3, and warmup-cosine's LR differs between updates)

Matrices (``parity_tests.cases.matrix``): CPU full = world {1, 2, 4} x k {1, 2, 4} x unit
{token, sample} x dtype {float32, float64}; CUDA full = the same with
{float32, bfloat16}; ``quick`` = three scenarios that cover both units, several
devices, the short window and (CPU) float64. Both add the loss-scaling scenario.
Negative controls run in float32.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import traceback
from collections.abc import Callable

import numpy as np

from parity_tests import cases, compare, run_jax, run_torch
from parity_tests.cases import Case, Plan
from parity_tests.checks import Check
from parity_tests.compare import TOLERANCES, Run, SuiteResult
from parity_tests.scenarios import Scenario
from torch_ref import buggy

Task = tuple[str, Callable[[], dict[str, Run]]]  # (description, () -> {run key: Run})


def run_suite(
    device: str = "cpu",
    quick: bool = False,
    *,
    progress: bool = True,
    scns: list[Scenario] | None = None,
    controls: list[Scenario] | None = None,
) -> SuiteResult:
    """Runs the suite (or the given scenarios) and builds every :class:`Check`.

    Args:
      device: "cpu" (JAX's CPU devices, torch gloo) or "cuda" (one GPU for both).
      quick: the quick matrix instead of the full one.
      progress: show a tqdm progress bar.
      scns, controls: override the matrix.
    """
    t0 = time.perf_counter()
    plan = cases.plan(device, quick, scns, controls)
    torch_groups = _torch_groups(plan)
    runs: dict[str, Run] = {}
    errors: dict[str, str] = {}
    tasks = _torch_tasks(torch_groups, device) + _jax_tasks(plan, quick)
    _run_tasks(tasks, progress, runs, errors)
    for world, group in torch_groups.items():  # the runs of a torch group that failed
        for key, _ in group:
            if key not in runs:
                errors.setdefault(key, f"not run: its torch_ref group R={world} failed")
    checks = build_checks(plan, runs)
    return SuiteResult(device, quick, checks, runs, errors, time.perf_counter() - t0, plan.named)


def _key(kind: str, case: Case | Scenario, bug: str | None = None) -> str:
    """A run's key: its kind, the scenario's name, the bug."""
    return f"{kind}|{case.name}" + (f"|{bug}" if bug else "")


def _bugs(case: Case) -> list[str]:
    """The bugs of ``torch_ref.buggy`` run on ``case``: on the loss-scaling case those seen
    only on a skipped window (``Variant.overflow_only``), on a control case the others."""
    return [bug for bug, v in buggy.VARIANTS.items() if v.overflow_only == case.scaled]


def _torch_groups(plan: Plan) -> dict[int, list[tuple[str, run_torch.TorchJob]]]:
    """torch_ref's runs by world size, one launch each (world 1 runs in-process): every
    big batch, every scenario that is no big batch, each control (and the loss-scaling
    case) with its bugs (:func:`_bugs`)."""
    jobs: dict[int, list[tuple[str, run_torch.TorchJob]]] = {}

    def add(key, job):
        jobs.setdefault(1 if job.big_batch else job.case.scn.world, []).append((key, job))

    for big in plan.bigs:
        add(_key("torch big", big), run_torch.TorchJob(big, big_batch=True))
    for case in plan.cases:
        if case.big is not None:
            add(_key("torch", case), run_torch.TorchJob(case, count_comm=case in plan.controls))
    for ctl in plan.controls + [c for c in plan.cases if c.scaled]:
        if ctl not in plan.cases:
            add(_key("torch", ctl), run_torch.TorchJob(ctl, count_comm=True))
        for bug in _bugs(ctl):
            add(_key("torch", ctl, bug), run_torch.TorchJob(ctl, bug=bug, count_comm=True))
    return jobs


def _torch_tasks(groups: dict[int, list[tuple[str, run_torch.TorchJob]]], device: str):
    """One task per world size: its jobs in one launch."""
    tasks: list[Task] = []
    for world, group in sorted(groups.items()):

        def torch_group(group=group):
            done = run_torch.run_torch_jobs([j for _, j in group], device=device)
            return {key: run for (key, _), run in zip(group, done, strict=False)}

        tasks.append((f"torch_ref R={world} ({len(group)} runs)", torch_group))
    return tasks


def _jax_tasks(plan: Plan, quick: bool) -> list[Task]:
    """The JAX big batches, jaxaccum on every scenario, optax.MultiSteps on the controls.

    The JAX big batch costs a compilation per (unit, dtype): the quick matrix runs it
    for the control scenarios only (its other scenarios meet the torch big batch instead).
    """
    tasks: list[Task] = []
    bigs = [c.big or c for c in plan.controls] if quick else plan.bigs
    for big in dict.fromkeys(bigs):
        key = _key("jax big", big)
        tasks.append((key, lambda key=key, case=big: {key: run_jax.run_big_batch(case)}))
    for case in plan.cases + [c for c in plan.controls if c not in plan.cases]:
        key = _key("jaxaccum", case)
        tasks.append((key, lambda key=key, case=case: {key: run_jax.run_jaxaccum(case)}))
    for ctl in plan.controls + [c for c in plan.cases if c.scaled]:
        key = _key("optax.MultiSteps", ctl)
        tasks.append((key, lambda key=key, case=ctl: {key: run_jax.run_optax_multisteps(case)}))
    return tasks


def _run_tasks(tasks: list[Task], progress: bool, runs: dict, errors: dict) -> None:
    """Runs ``(description, fn)`` tasks under a tqdm progress bar (``progress``).

    Each ``fn`` returns ``{run key: Run}``; a task that raises is recorded in
    ``errors`` under its description (and fails the suite), the others go on.
    """
    from tqdm import tqdm

    with tqdm(total=len(tasks), unit="run", dynamic_ncols=True, disable=not progress,
              file=sys.stderr) as bar:  # fmt: skip
        for desc, fn in tasks:
            bar.set_description(desc[:60])
            try:
                runs.update(fn())
            except Exception:  # noqa: BLE001 - recorded, reported, and fails the suite
                errors[desc] = traceback.format_exc(limit=6)
            bar.update(1)


def _torch_run(runs: dict[str, Run], case: Case) -> Run | None:
    """torch_ref's run of ``case`` (its big batch run when the layout is R = k = 1)."""
    return runs.get(_key("torch big" if case.big is None else "torch", case))


def build_checks(plan: Plan, runs: dict[str, Run]) -> list[Check]:
    """Every comparison whose runs exist (a missing run is in the suite's ``errors``)."""
    checks = []

    def add(case, a, b):
        if a is not None and b is not None:
            tol = TOLERANCES[case.dtype]
            skips = [bool(np.isinf(p).any()) for p in case.poison] if case.scaled else None
            checks.append(
                compare.compare(case.name, a, b, tol, scaling=case.scaled, expected_skipped=skips)
            )

    for big in plan.bigs:
        add(big, runs.get(_key("jax big", big)), runs.get(_key("torch big", big)))
    for case in plan.cases:
        big = case.big or case
        ja, tr = runs.get(_key("jaxaccum", case)), _torch_run(runs, case)
        add(case, ja, tr)
        if case.scaled:  # a skipped window: no big batch to match, only jaxaccum vs torch_ref
            checks += _poisoned_state_control(case, ja, runs) + _overflow_controls(case, tr, runs)
            continue
        add(case, ja, runs.get(_key("jax big", big)))
        if case.big is not None:
            add(case, ja, runs.get(_key("torch big", big)))
            add(case, tr, runs.get(_key("torch big", big)))
    for ctl in plan.controls:
        checks += _control_checks(ctl, runs)
    return checks


def _control_checks(ctl: Case, runs: dict[str, Run]) -> list[Check]:
    """The negative controls of ``ctl``, each against its framework's big batch (fp32's
    tolerance); the communication-only bug by its all-reduces against torch_ref's."""
    big, tol, checks = ctl.big or ctl, TOLERANCES["float32"], []
    jbig, tbig = runs.get(_key("jax big", big)), runs.get(_key("torch big", big))
    ms, tr = runs.get(_key("optax.MultiSteps", ctl)), _torch_run(runs, ctl)
    if ms is not None and jbig is not None:
        checks.append(compare.compare(ctl.name, ms, jbig, tol, "control"))
    for bug in _bugs(ctl):
        run = runs.get(_key("torch", ctl, bug))
        if run is None or tbig is None:
            continue
        if buggy.VARIANTS[bug].communication_only:
            comm = (_allreduces(run), _allreduces(tr)) if tr is not None else None
            checks.append(compare.compare(ctl.name, run, tbig, tol, "comm-control", comm))
        else:
            checks.append(compare.compare(ctl.name, run, tbig, tol, "control"))
    return checks


def _poisoned_state_control(case: Case, jaxaccum_run: Run | None, runs: dict) -> list[Check]:
    """The loss-scaling case's control: optax.MultiSteps, which skips no window, against
    jaxaccum, which skips the one with the inf: one inf poisons every later update."""
    ms = runs.get(_key("optax.MultiSteps", case))
    if ms is None or jaxaccum_run is None:
        return []
    ms = dataclasses.replace(ms, label="optax.MultiSteps (no skip)")
    return [compare.compare(case.name, ms, jaxaccum_run, TOLERANCES["float32"], "poison-control")]


def _overflow_controls(case: Case, torch_ref_run: Run | None, runs: dict) -> list[Check]:
    """The loss-scaling case's torch bugs (:func:`_bugs`), each against torch_ref on the same
    case (fp32's tolerance): the same loop until the window with the inf."""
    checks = []
    for bug in _bugs(case):
        run = runs.get(_key("torch", case, bug))
        if run is not None and torch_ref_run is not None:
            tol = TOLERANCES["float32"]
            checks.append(compare.compare(case.name, run, torch_ref_run, tol, "control"))
    return checks


def _allreduces(run: Run) -> float:
    """Mean number of backward passes per window that launched a gradient all-reduce."""
    comm = run.extra.get("comm") or []
    return float(np.mean([c["synced_backwards"] for c in comm])) if comm else math.nan
