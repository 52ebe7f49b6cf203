"""The report of one cut of TRL's GRPO update: `GRPOInvarianceReport`, from both runs'
updates and each sequence's gradient (`bigbatch.invariance_report`)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch import nn

import bigbatch
from torch_ref._audit_args import _numpy, _parameters
from torch_ref._audit_trl_cut import NUM_GENERATIONS, GRPOCut
from torch_ref._audit_trl_rows import WORDS
from torch_ref._audit_trl_trainer import LEARNING_RATE, first_update_prompts
from torch_ref._trainer_runs import TrainerResult

TRL_SAYS = {
    "bnpo": '"Note that normalization is performed over the local batch only, so results may'
    ' slightly vary depending on the local batch size, despite a constant effective batch size."'
    " (trl/trainer/grpo_config.py:249-252)",
    "entropy": '"The adaptive controller below tracks a window-global token-weighted mean, which'
    ' can differ from this per-micro-batch mean when token counts vary across micro-batches."'
    " (trl/trainer/grpo_trainer.py:3196-3197, on the entropy bonus)",
}
"""What TRL 1.16 writes of the terms that depend on the cut; the report quotes it."""


@dataclasses.dataclass(frozen=True, eq=False, repr=False)  # the summary as repr, as its base
class GRPOInvarianceReport(bigbatch.InvarianceReport):
    """`bigbatch.InvarianceReport` of one cut of TRL's GRPO update, and what TRL saw.

    The cells of ``weights`` and ``row_items`` are the window's sequences (in the
    one-batch run's order), each with the gradient of its policy term
    ``sum_t -A_i log p_it`` (at ratio 1), then, with ``entropy_coef``, the same
    sequences with that of their entropy bonus without its coefficient, ``sum_t -H_it``
    (the weights are ratios to the one-batch run's, whatever a cell's scale).

    Its attributes are `bigbatch.InvarianceReport`'s and these.

    Attributes:
      cut: the audited `GRPOCut` (``steps_per_generation`` and ``epsilon_high`` resolved).
      tokens: float64 ``[sequences]``, each sequence's valid completion tokens ``|o_i|``.
      advantages: float64 ``[sequences]``, the advantages TRL computed (equal in both runs).
      microbatches: int64 ``[sequences, 2]``, the rank and micro-step of each sequence in
        the cut's first update.
      generation_tokens: the valid completion tokens of the cut's generation batch over
        all ranks (TRL's ``num_items_in_batch``).
      big_batch_differences: float64 ``[2]``, the one-batch run's and the cut's
        ``|delta - delta_big| / |delta_big|``, where ``delta_big`` is the token big batch
        (``docs/math.md``: the sum over tokens / ``N``) of the same terms: ``-lr / N sum_cells G_c``.
    """

    cut: GRPOCut = GRPOCut("dapo", 1)
    tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    advantages: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    microbatches: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 2), int))
    generation_tokens: float = 0.0
    big_batch_differences: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(2))

    @property
    def window_tokens(self) -> float:
        """The valid completion tokens of the audited update."""
        return float(np.sum(self.tokens))

    def __str__(self) -> str:
        c, (one, cut) = self.cut, self.big_batch_differences
        terms = "policy terms" + (", then their entropy bonus" if c.entropy_coef else "")
        return "\n".join([
            f"TRL GRPOTrainer, loss_type={c.loss_type!r}, entropy_coef={c.entropy_coef:g},"
            f" epsilon_high={c.epsilon_high}: {c.name} against GA=1 x spg=1 x R=1",
            super().__str__(),
            f"cells: {self.tokens.size} sequences' {terms}; {self.window_tokens:g} tokens in the"
            f" update, {self.generation_tokens:g} in the cut's generation batch",
            f"vs the token big batch of the same terms: one batch {one:.1e}, the cut {cut:.1e}",
            *[f"TRL on it: {said}" for name, said in TRL_SAYS.items() if name in self._broken],
        ])  # fmt: skip

    @property
    def _broken(self) -> tuple[str, ...]:
        """When not invariant: the loss type, and ``"entropy"`` with an entropy bonus."""
        terms = (self.cut.loss_type,) + (("entropy",) if self.cut.entropy_coef else ())
        return () if self.invariant else terms


def cut_report(
    cut: GRPOCut, model: nn.Module, one: TrainerResult, cut_result: TrainerResult, progress: bool
) -> GRPOInvarianceReport:
    """Both runs' updates, the cells' gradients, `bigbatch.invariance_report` and TRL's view."""
    (record,) = one.records[0]  # one micro-batch on one rank
    rows = list(zip(record["prompts"], record["completions"], record["advantages"], strict=True))
    expected = [p for p in first_update_prompts(cut) for _ in range(NUM_GENERATIONS)]
    if [int(WORDS[prompt[0]][1:]) for prompt, _, _ in rows] != expected:
        raise RuntimeError(f"GRPOTrainer: the one-batch run read other prompts than {expected}")
    microbatches = _microbatches(cut_result.records, rows)
    tokens = np.array([len(completion) for _, completion, _ in rows], np.float64)
    grads = _cell_gradients(model, rows, bool(cut.entropy_coef))
    before = _numpy(_parameters(model))
    deltas = [
        [
            np.asarray(n, np.float64) - b.astype(np.float64)
            for n, b in zip(result.params, before, strict=True)
        ]
        for result in (one, cut_result)
    ]
    report = bigbatch.invariance_report(
        [cut.name], deltas[0], [deltas[1]], row_items=np.tile(tokens, len(grads) // len(rows)),
        row_grad=grads.__getitem__, progress=progress, learning_rate=LEARNING_RATE,
    )  # fmt: skip
    # the entropy cells without their coefficient (a fit's weights are ratios, whatever a
    # cell's scale; a small coefficient would shrink their Gram matrix by its square)
    scales = [1.0] * len(rows) + [cut.entropy_coef] * (len(grads) - len(rows))
    big = [
        -LEARNING_RATE / tokens.sum() * sum(c * g for c, g in zip(scales, leaves, strict=True))
        for leaves in zip(*grads, strict=True)
    ]
    return GRPOInvarianceReport(
        **{f.name: getattr(report, f.name) for f in dataclasses.fields(report)},
        cut=cut, tokens=tokens, advantages=np.array([a for _, _, a in rows]),
        microbatches=microbatches,
        generation_tokens=cut_result.records[0][0]["num_items_in_batch"],
        big_batch_differences=np.array([_relative(d, big) for d in deltas]),
    )  # fmt: skip


def _microbatches(records: list[list[dict]], rows: list[tuple]) -> np.ndarray:
    """``[rows, 2]``: the rank and micro-step of each row in the cut; checks that the cut's
    first update holds exactly these rows, with the same advantages."""
    where = {}
    for rank, micro_batches in enumerate(records):
        for step, record in enumerate(micro_batches):
            rows_here = (record["prompts"], record["completions"], record["advantages"])
            for p, c, a in zip(*rows_here, strict=True):
                where[(tuple(p), tuple(c))] = (rank, step, a)
    keys = [(tuple(p), tuple(c)) for p, c, _ in rows]
    same = sorted(where) == sorted(keys) and all(
        math.isclose(where[key][2], a, rel_tol=1e-6, abs_tol=1e-6)
        for key, (_, _, a) in zip(keys, rows, strict=True)
    )
    if not same:
        raise RuntimeError(
            "GRPOTrainer: the cut's first update does not hold the one-batch run's rows with"
            " their advantages: this TRL version deals rows to ranks and micro-batches otherwise"
        )
    return np.array([where[key][:2] for key in keys], np.int64)


def _cell_gradients(
    model: nn.Module, rows: list[tuple], with_entropy: bool
) -> list[list[np.ndarray]]:
    """Each row's gradient of ``sum_t -A log p_t`` (the policy term at ratio 1), then,
    ``with_entropy``, each row's of ``sum_t -H_t`` (the bonus without its coefficient);
    float32 leaves."""
    params, policy, entropy = _parameters(model), [], []
    for prompt, completion, advantage in rows:
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # temperature 1
        token_logp = logp.gather(-1, torch.tensor(completion)[:, None]).sum()
        policy.append(
            _numpy(torch.autograd.grad(-advantage * token_logp, params, retain_graph=True))
        )
        if with_entropy:
            h = -(logp.exp() * logp).sum()
            entropy.append(_numpy(torch.autograd.grad(-h, params)))
    return policy + entropy


def _relative(update: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """``|update - reference| / |reference|`` over every leaf, float64."""
    gap = math.fsum(float(np.sum(np.square(u - r))) for u, r in zip(update, reference, strict=True))
    return math.sqrt(gap / math.fsum(float(np.sum(np.square(r))) for r in reference))
