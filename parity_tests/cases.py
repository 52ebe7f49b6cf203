"""What a run of the suite runs: the matrix of scenarios, each turned ONCE into a `Case`.

The suite's matrix (:func:`matrix`) and, at the top of its flow, :func:`plan`:
every scenario of a run turned ONCE into a :class:`Case`, its dtypes and
arrays (the windows laid out, the injected overflows, the items per window),
which the JAX run, the torch run and the comparisons then take as they are.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from parity_tests.scenarios import LossScaling, Optimizer, Scenario, layouts
from tinygpt import TinyGPTConfig, data
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
# DEFAULT_OPT's warmup-cosine gives window 4 the LR of update 3 (9.3e-4); a schedule that moved
# on the skipped window gives it update 4's (7.5e-4): torch_ref.buggy's scheduler_per_window.
LOSS_SCALING = LossScaling(init_scale=2.0**10, growth_interval=2, inf_microbatches=((3, 1, 0),))


def scaling_scenario() -> Scenario:
    """The loss-scaling scenario: the control scenario (R2k2 token fp32) with :data:`LOSS_SCALING`."""
    return dataclasses.replace(control_scenario(), loss_scaling=LOSS_SCALING)


def matrix(device: str = "cpu", quick: bool = False) -> tuple[list[Scenario], list[Scenario]]:
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


# ---------------------------------------------------------------------- cases: the arrays

# A scenario dtype -> (parameter dtype, matmul compute dtype or None, torch_ref's precision).
PRECISIONS = {
    "float32": (np.dtype(np.float32), None, "fp32"),
    "float64": (np.dtype(np.float64), None, "fp64"),
    "bfloat16": (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), "bf16"),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """A scenario turned into its dtypes and arrays, once (:func:`prepare`): what runs.

    Plain fields only: the runs, the comparisons and the report read them as they are.

    Attributes:
      scn: the scenario.
      name, short_name, dtype: the scenario's (:attr:`Scenario.name`, ...).
      big: the case of the scenario's big batch; None: this case is one.
      scaled: whether the case has loss scaling (and so no big batch to match).
      weights: the initial weights, torch layout, numpy.
      param_dtype: the parameters' (and the accumulators') dtype.
      compute_dtype: the matmuls' dtype (bfloat16), or None: the parameters'.
      x64: whether the JAX runs need ``jax.enable_x64`` (float64 parameters).
      precision: the same policy in ``torch_ref``'s words ("fp32", "fp64", "bf16").
      windows: per update ``(tokens, labels)`` int32 ``[R, k_u, mb, T]`` (:func:`layouts`).
      poison: per update the logits' multipliers ``[R, k_u, mb]`` in the parameter
        dtype: +inf on the micro-batches the loss scaling poisons, 1 elsewhere.
      items: per update the window's global loss units (valid tokens or samples).
    """

    scn: Scenario
    name: str
    short_name: str
    dtype: str
    big: Case | None
    scaled: bool
    weights: dict[str, np.ndarray]
    param_dtype: np.dtype
    compute_dtype: np.dtype | None
    x64: bool
    precision: str
    windows: list[tuple[np.ndarray, np.ndarray]]
    poison: list[np.ndarray]
    items: list[float]


def prepare(scn: Scenario, weights: dict[str, np.ndarray], big: Case | None = None) -> Case:
    """The :class:`Case` of ``scn``: its dtypes and every array both frameworks read
    (``big``: its big batch's case; None when ``scn`` is a big batch)."""
    param_dtype, compute_dtype, precision = PRECISIONS[scn.dtype]
    windows = layouts(scn)
    poison = []
    for u, (tokens, _) in enumerate(windows):
        mult = np.ones(tokens.shape[:3], param_dtype)
        for r, m in np.ndindex(*tokens.shape[:2]):
            if scn.loss_scaling is not None and scn.loss_scaling.poison(u, r, m):
                mult[r, m] = np.inf
        poison.append(mult)
    items = [float(data.units(labels, scn.unit).sum()) for _, labels in windows]
    x64 = param_dtype == np.float64
    return Case(scn, scn.name, scn.short_name, scn.dtype, big, scn.loss_scaling is not None,
                weights, param_dtype, compute_dtype, x64, precision, windows, poison,
                items)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run of the suite runs, as cases: its scenarios, controls, their big batches."""

    cases: list[Case]  # the scenarios'
    controls: list[Case]  # the negative controls' (a scenario's own case where it is one)
    bigs: list[Case]  # every distinct big batch, in order
    named: dict[str, Case]  # all of them, by name


def plan(
    device: str = "cpu",
    quick: bool = False,
    scns: list[Scenario] | None = None,
    controls: list[Scenario] | None = None,
) -> Plan:
    """The suite's :class:`Plan`: the matrix (or the given scenarios), each prepared once
    from the suite's weights (``init_state_dict(TinyGPTConfig(), WEIGHT_SEED)``)."""
    default_scns, default_controls = matrix(device, quick)
    scns = default_scns if scns is None else scns
    controls = default_controls if controls is None else controls
    weights = init_state_dict(TinyGPTConfig(), seed=WEIGHT_SEED)
    bigs = {b: prepare(b, weights) for b in dict.fromkeys(s.big_batch() for s in scns + controls)}
    cases = {
        s: bigs[s] if s in bigs else prepare(s, weights, bigs[s.big_batch()])
        for s in dict.fromkeys(scns + controls)
    }
    named = {c.name: c for c in [*cases.values(), *bigs.values()]}
    return Plan([cases[s] for s in scns], [cases[s] for s in controls], list(bigs.values()), named)
