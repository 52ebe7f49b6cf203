"""`torch_ref.audit.audit_trl_grpo`: does TRL's GRPO update depend on how its window is cut?

The audit in four parts: the cut and its checks (``_audit_trl_cut.py``), the rows and
the model (``_audit_trl_rows.py``), TRL's trainer that records them
(``_audit_trl_trainer.py``) and the report (``_audit_trl_report.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch_ref._audit_trl_cut import GRPOCut, check_cut
from torch_ref._audit_trl_report import GRPOInvarianceReport, cut_report
from torch_ref._audit_trl_rows import rollouts, tiny_gpt2
from torch_ref._audit_trl_trainer import cut_run, one_batch_run, run_key
from torch_ref._trainer_runs import offline, run_trainers
from torch_ref.ddp import one_cpu_thread


def audit_trl_grpo(
    loss_type: str,
    *,
    gradient_accumulation_steps: int,
    steps_per_generation: int | None = None,
    world_size: int = 1,
    entropy_coef: float = 0.0,
    epsilon_high: float | None = None,
    timeout_s: float = 300.0,
    progress: bool = True,
) -> GRPOInvarianceReport:
    """Runs TRL's ``GRPOTrainer`` for one update cut one way and in one batch, and compares.

    .. math::

       \\mathrm{difference} = \\frac{|\\delta_{cut} - \\delta_{one}|}{|\\delta_{one}|},
       \\qquad -\\frac{\\delta}{lr} = \\sum_i w_i \\nabla_\\theta
       \\sum_t (-A_i \\log p_{it}) + e

    Fixed rows, no generation: a tiny GPT-2 built from a config (random weights,
    dropout off), an in-memory word-level tokenizer, prompts of one length (GPT-2
    takes positions from the padding, so unequal prompts would move each other),
    `NUM_GENERATIONS` completions per prompt of different lengths
    (`COMPLETION_LENGTHS`) handed in by ``rollout_func``, fixed rewards (a
    permutation of 0, 1, 2, 4 per group: no advantage is 0), ``beta=0``, SGD at
    learning rate 1, ``max_steps=1``, CPU. The cut (``gradient_accumulation_steps``,
    ``steps_per_generation``, ``world_size`` gloo ranks) trains on the generation
    batch of its settings; the reference, ``GA=1 x spg=1 x R=1``, on exactly the
    rows of the cut's first update. The report's weights are each sequence's
    weight in the cut relative to the one-batch run, fitted from the sequences'
    policy gradients at ratio 1 (autograd, float64 fit, `bigbatch.invariance_report`).

    How the cut is known: a ``GRPOTrainer`` subclass records the rows of every
    micro-batch in ``_compute_loss`` (the rank and micro-step of each sequence)
    and leaves out TRL's per-rank shuffle of the generation batch before it is
    cut into micro-batches (``shuffle_sequence_dict``, ``trl/trainer/utils.py:1092``,
    called at ``grpo_trainer.py:1543``; a ``torch.randperm`` from the global RNG).
    The shuffle only picks which rows share a micro-batch and, with several
    updates per generation, which rows form the first update; with it, that
    update would hold parts of prompt groups, whose group-normalized advantages
    no one-batch run of those rows could reproduce. Without it, each rank's first
    update is the first ``GA x per_device_train_batch_size`` rows of its share of
    the generation batch: whole prompt groups, the same advantages (checked).

    With ``steps_per_generation = 2 GA`` one generation feeds two updates and only
    the first is audited: TRL computes the old log-probabilities once per
    generation, so the second update's importance ratios are no longer 1 (the
    first moved the parameters): its gradient depends on the first update,
    clipping may act, and no one-batch run of its rows starts from the same
    parameters. The first update's ratios are 1 up to float rounding.

    Args:
      loss_type: one of `LOSS_TYPES`. ``luspo`` runs with
        ``importance_sampling_level="sequence"`` (which it requires).
      gradient_accumulation_steps: GA; ``GA x world_size`` must divide
        `WINDOW_ROWS`.
      steps_per_generation: None (= GA, TRL's default) or ``2 GA``.
      world_size: 1 (this process) or the gloo ranks (2 or 4: each rank's share
        of the update holds whole prompt groups).
      entropy_coef: ``GRPOConfig.entropy_coef``; when not 0 the cells include
        each sequence's entropy bonus.
      epsilon_high: None: `CISPO_EPSILON_HIGH` for cispo (TRL's default would scale
        cispo's update by ``epsilon = 0.2``), TRL's default for the others.
      timeout_s: the bound of the run on ranks, start-up included.
      progress: a progress bar while the sequences' gradients are computed.

    Returns:
      A `GRPOInvarianceReport` (a ``bigbatch.InvarianceReport``: ``invariant``,
      ``worst``, ``weights``; ``print(report)`` shows the table).

    Raises:
      ImportError: without ``trl`` and ``datasets`` (``pip install .[trl]``).

    Example (``torch_ref/_audit_trl_test.py`` runs it)::

      report = audit_trl_grpo("bnpo", gradient_accumulation_steps=4)
      report.invariant  # -> False: a token mean per micro-batch
    """
    cut = GRPOCut(
        loss_type, gradient_accumulation_steps, steps_per_generation, world_size,
        entropy_coef, epsilon_high,
    )  # fmt: skip
    return audit_trl_grpo_cuts([cut], timeout_s=timeout_s, progress=progress)[0]


def audit_trl_grpo_cuts(
    cuts: Sequence[GRPOCut], *, timeout_s: float = 600.0, progress: bool = True
) -> list[GRPOInvarianceReport]:
    """`audit_trl_grpo` for many cuts, the runs of one world size in one launch of ranks.

    Args:
      cuts: the cuts, `GRPOCut` tuples (checked as `audit_trl_grpo` checks its arguments).
      timeout_s: the bound of each launch of ranks (all the runs of a world size).
      progress: a progress bar while the sequences' gradients are computed.

    Returns:
      A `GRPOInvarianceReport` per cut, in order. A run that two cuts share (the
      same rows and settings) runs once.
    """
    cuts = [check_cut(*cut) for cut in cuts]
    offline()
    try:  # the optional extra .[trl]: an ImportError here, not in a rank
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as error:
        message = f"audit_trl_grpo needs trl and datasets (pip install '.[trl]'): {error}"
        raise ImportError(message) from error
    with one_cpu_thread():  # a tiny model: one intra-op thread (torch_ref.ddp.one_cpu_thread)
        model, pool = tiny_gpt2(), rollouts()
        plans = [(one_batch_run(cut, pool), cut_run(cut, pool)) for cut in cuts]
        unique = {run_key(*run): run for plan in plans for run in plan}  # a shared run runs once
        results = {}
        for ranks in sorted({ranks for ranks, _ in unique.values()}):
            keys = [key for key, (r, _) in unique.items() if r == ranks]
            runs = [unique[key][1] for key in keys]
            done = run_trainers(runs, model, world_size=ranks, timeout_s=timeout_s, what="GRPO")
            results.update(zip(keys, done, strict=True))
        return [
            cut_report(cut, model, results[run_key(*one)], results[run_key(*at_cut)], progress)
            for cut, (one, at_cut) in zip(cuts, plans, strict=True)
        ]
