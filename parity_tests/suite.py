"""The parity suite: which scenarios run, through what, and which comparisons decide.

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
    no_sync_backward_only: gradient all-reduces per window vs torch_ref (same
    numbers by design; the bug is k x the communication)

and on the loss-scaling scenario (:func:`scaling_scenario`: the control scenario
with fp16 dynamic loss scaling, fp32 compute, an inf injected into one
micro-batch of one rank in window 3, the same way on both sides):

    jaxaccum  vs torch_ref          the same windows skipped, the same loss-scale and
                                    update_id sequences (exactly), parameters within fp32

Matrices (:func:`scenarios`): CPU full = world {1, 2, 4} x k {1, 2, 4} x unit
{token, sample} x dtype {float32, float64}; CUDA full = the same with
{float32, bfloat16}; ``quick`` = three scenarios that cover both units, several
devices, the short window and (CPU) float64. Both add the loss-scaling scenario.
Negative controls run in float32.
"""

from __future__ import annotations

import dataclasses
import math
import time
import traceback

import numpy as np

from parity_tests import compare
from parity_tests.compare import TOLERANCES, Check, Run
from parity_tests.scenarios import LossScaling, Optimizer, Scenario
from tinygpt import TinyGPTConfig
from tinygpt.weights import init_state_dict

# Warmup-cosine over the 5 updates and clipping that is active in the first
# windows (the default data's window gradient norms are ~3.3, 3.3, 3.3, 2.1,
# 2.0): the schedule, clipping and short-window paths all matter.
DEFAULT_OPT = Optimizer(schedule="warmup_cosine", max_grad_norm=2.5)
WEIGHT_SEED = 0  # every scenario starts from tinygpt.weights.init_state_dict(..., WEIGHT_SEED)
SHORT_WINDOW = 2  # window 2 has half the samples and 1 micro-batch per rank (an epoch end)


def scenario(world: int, k: int, unit: str = "token", dtype: str = "float32") -> Scenario:
    """A scenario of the suite: default data and optimizer, the short window (``k_short = 1``)."""
    return Scenario(
        world=world, k=k, unit=unit, dtype=dtype, opt=DEFAULT_OPT, short_window=SHORT_WINDOW
    )


def control_scenario(dtype: str = "float32") -> Scenario:
    """Where the negative controls run: R=2, k=2, token unit."""
    return scenario(2, 2, "token", dtype)


# fp16 dynamic loss scaling (fp32 compute) on R2k2: scale 2**10, doubled after every 2 applied
# windows, and an inf injected into rank 1's first micro-batch of window 3: expected
# skipped F F F T F and next-window scales 1024 2048 2048 1024 1024 (a growth, then a backoff).
LOSS_SCALING = LossScaling(init_scale=2.0**10, growth_interval=2, inf_microbatches=((3, 1, 0),))


def scaling_scenario() -> Scenario:
    """The loss-scaling scenario: the control scenario (R2k2 token fp32) with :data:`LOSS_SCALING`."""
    return dataclasses.replace(control_scenario(), loss_scaling=LOSS_SCALING)


def scenarios(device: str = "cpu", quick: bool = False) -> tuple[list[Scenario], list[Scenario]]:
    """``(scenarios, control scenarios)`` of a run of the suite."""
    dtypes = ("float32", "float64") if device == "cpu" else ("float32", "bfloat16")
    if quick:
        scns = [
            control_scenario(),
            scenario(4, 1, "sample"),
            scenario(2, 2, "token", dtypes[1]),
            scaling_scenario(),
        ]
        return scns, [control_scenario()]
    scns = [
        scenario(w, k, u, d)
        for d in dtypes
        for u in ("token", "sample")
        for w in (1, 2, 4)
        for k in (1, 2, 4)
    ]
    scns.append(scaling_scenario())
    # Controls in fp32 only: they are judged against the fp32 tolerance, and bf16 noise alone
    # (~5e-2 of the movement) would pass for a "flag" there.
    return scns, [control_scenario("float32")]


@dataclasses.dataclass
class SuiteResult:
    """Everything a run of the suite produced."""

    device: str
    quick: bool
    checks: list[Check]
    runs: dict[str, Run]  # by run key (see ``_key``)
    errors: dict[str, str]  # run key -> traceback of a run that failed
    seconds: float
    scenarios: dict[str, Scenario]  # every scenario run (and its big batch), by name

    @property
    def passed(self) -> bool:
        return not self.errors and all(c.passed for c in self.checks)


def _key(kind: str, scn: Scenario, bug: str | None = None) -> str:
    return f"{kind}|{scn.name}" + (f"|{bug}" if bug else "")


class _Tasks:
    """Runs ``(description, fn)`` tasks under a tqdm progress bar.

    Each ``fn`` returns ``{run key: Run}``; a task that raises is recorded in
    ``errors`` under its description (and fails the suite), the others go on.
    """

    def __init__(self):
        self.items = []

    def add(self, desc: str, fn) -> None:
        self.items.append((desc, fn))

    def run(self, progress: bool, runs: dict[str, Run], errors: dict[str, str]) -> None:
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(self.items), unit="run", dynamic_ncols=True)
        for desc, fn in self.items:
            if bar is not None:
                bar.set_description(desc[:60])
            try:
                runs.update(fn())
            except Exception:  # noqa: BLE001 - recorded, reported, and fails the suite
                errors[desc] = traceback.format_exc(limit=6)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()


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
    import torch_ref
    from parity_tests import run_jax, run_torch

    t0 = time.perf_counter()
    default_scns, default_controls = scenarios(device, quick)
    scns = default_scns if scns is None else scns
    controls = default_controls if controls is None else controls
    weights = init_state_dict(TinyGPTConfig(), seed=WEIGHT_SEED)
    runs: dict[str, Run] = {}
    errors: dict[str, str] = {}
    bigs = list(dict.fromkeys(s.big_batch() for s in scns + controls))

    # torch_ref: one batch of jobs per world size: one DDP spawn each (world 1 runs in-process).
    jobs: dict[int, list[tuple[str, run_torch.TorchJob]]] = {}

    def add_job(key, job):
        jobs.setdefault(1 if job.big_batch else job.scn.world, []).append((key, job))

    for big in bigs:
        add_job(_key("torch big", big), run_torch.TorchJob(big, big_batch=True))
    for scn in scns:
        if scn != scn.big_batch():
            add_job(_key("torch", scn), run_torch.TorchJob(scn, count_comm=scn in controls))
    for ctl in controls:
        if ctl not in scns:
            add_job(_key("torch", ctl), run_torch.TorchJob(ctl, count_comm=True))
        for bug in torch_ref.buggy.VARIANTS:
            add_job(_key("torch", ctl, bug), run_torch.TorchJob(ctl, bug=bug, count_comm=True))

    tasks = _Tasks()
    for world, group in sorted(jobs.items()):

        def torch_group(group=group):
            done = run_torch.run_torch_jobs([j for _, j in group], weights, device=device)
            return {key: run for (key, _), run in zip(group, done, strict=False)}

        tasks.add(f"torch_ref R={world} ({len(group)} runs)", torch_group)
    # The JAX big batch costs a compilation per (unit, dtype): the quick matrix runs it for the
    # control scenarios only (its other scenarios meet the torch big batch instead).
    for big in dict.fromkeys([c.big_batch() for c in controls] if quick else bigs):
        key = _key("jax big", big)
        tasks.add(key, lambda key=key, big=big: {key: run_jax.run_big_batch(big, weights)})
    for scn in scns + [c for c in controls if c not in scns]:
        key = _key("jaxaccum", scn)
        tasks.add(key, lambda key=key, scn=scn: {key: run_jax.run_jaxaccum(scn, weights)})
    for ctl in controls:
        key = _key("optax.MultiSteps", ctl)
        tasks.add(key, lambda key=key, ctl=ctl: {key: run_jax.run_optax_multisteps(ctl, weights)})
    tasks.run(progress, runs, errors)
    for world, group in jobs.items():  # the runs of a torch group that failed
        for key, _ in group:
            if key not in runs:
                errors.setdefault(key, f"not run: its torch_ref group R={world} failed")

    checks = build_checks(scns, controls, runs)
    named = {s.name: s for s in scns + controls + bigs}
    return SuiteResult(device, quick, checks, runs, errors, time.perf_counter() - t0, named)


def _torch_run(runs, scn: Scenario) -> Run | None:
    """torch_ref's run of ``scn`` (its big batch run when the layout is R = k = 1)."""
    if scn == scn.big_batch():
        return runs.get(_key("torch big", scn))
    return runs.get(_key("torch", scn))


def build_checks(scns, controls, runs: dict[str, Run]) -> list[Check]:
    """Every comparison whose runs exist (a missing run is in the suite's ``errors``)."""
    import torch_ref

    checks = []

    def add(scn, a, b, kind="parity", comm=None):
        if a is not None and b is not None:
            checks.append(
                compare.compare(
                    scn.name,
                    a,
                    b,
                    TOLERANCES[scn.dtype],
                    kind,
                    comm,
                    scaling=scn.loss_scaling is not None,
                )
            )

    for big in dict.fromkeys(s.big_batch() for s in scns + controls):
        add(big, runs.get(_key("jax big", big)), runs.get(_key("torch big", big)))
    for scn in scns:
        big = scn.big_batch()
        ja, tr = runs.get(_key("jaxaccum", scn)), _torch_run(runs, scn)
        add(scn, ja, tr)
        if scn.loss_scaling is not None:
            continue  # a skipped window: no big batch to match, only jaxaccum vs torch_ref
        add(scn, ja, runs.get(_key("jax big", big)))
        if scn != big:
            add(scn, ja, runs.get(_key("torch big", big)))
        if scn != big:
            add(scn, tr, runs.get(_key("torch big", big)))
    for ctl in controls:
        big = ctl.big_batch()
        tol = TOLERANCES["float32"]  # controls are judged against the fp32 tolerance
        jbig, tbig, tr = (
            runs.get(_key("jax big", big)),
            runs.get(_key("torch big", big)),
            _torch_run(runs, ctl),
        )
        ms = runs.get(_key("optax.MultiSteps", ctl))
        if ms is not None and jbig is not None:
            checks.append(compare.compare(ctl.name, ms, jbig, tol, "control"))
        for bug in torch_ref.buggy.VARIANTS:
            run = runs.get(_key("torch", ctl, bug))
            if run is None or tbig is None:
                continue
            if torch_ref.buggy.VARIANTS[bug].communication_only:
                comm = (_allreduces(run), _allreduces(tr)) if tr is not None else None
                checks.append(compare.compare(ctl.name, run, tbig, tol, "comm-control", comm))
            else:
                checks.append(compare.compare(ctl.name, run, tbig, tol, "control"))
    return checks


def _allreduces(run: Run) -> float:
    """Mean number of backward passes per window that launched a gradient all-reduce."""
    comm = run.extra.get("comm") or []
    return float(np.mean([c["synced_backwards"] for c in comm])) if comm else math.nan
