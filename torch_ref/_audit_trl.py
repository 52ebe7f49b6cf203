"""`torch_ref.audit.audit_trl_grpo`: does TRL's GRPO update depend on how its window is cut?"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

import bigbatch
from torch_ref._audit_args import _numpy, _parameters
from torch_ref._trainer_runs import TrainerResult, TrainerRun, offline, run_trainers
from torch_ref.ddp import one_cpu_thread

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
"""Every ``GRPOConfig.loss_type`` of TRL 1.16 (``trl/trainer/grpo_config.py:801-835``)."""
NUM_GENERATIONS = 4
"""``num_generations``: the completions of one prompt (a group; advantages are group-normalized)."""
WINDOW_ROWS = 16
"""Completions in one optimizer update: ``per_device_train_batch_size x GA x R``."""
MAX_COMPLETION_LENGTH = 8
"""``max_completion_length``, ``dr_grpo``'s constant denominator."""
COMPLETION_LENGTHS = (
    (1, 2, 2, 3), (2, 4, 3, 5), (5, 7, 6, 8), (8, 6, 7, 4),
    (3, 1, 2, 2), (6, 8, 7, 5), (1, 2, 2, 3), (2, 3, 1, 2),
)  # fmt: skip
"""The completions' tokens, ``[prompt][generation]``: prompts 0-3 fill a window (the rows of
every cut with ``steps_per_generation = GA``), 4-7 the next one of a generation of two windows.
Micro-batches of every cut differ in tokens, so do the two windows of a generation, and no
group has two completions of one token (their entropy terms would be the same vector)."""
CISPO_EPSILON_HIGH = 5.0
"""``epsilon_high`` of ``cispo``: ScaleRL's value, which TRL's docstring recommends
(``grpo_config.py:184-188``). cispo weighs each token by ``min(ratio, epsilon_high)``
(``grpo_trainer.py:3109-3111``), ``min(1, epsilon_high)`` at the audited ratio 1; TRL's default
``epsilon_high = epsilon = 0.2`` (``grpo_trainer.py:945-946``) would scale cispo's update by 0.2."""
TRL_SAYS = {
    "bnpo": '"Note that normalization is performed over the local batch only, so results may'
    ' slightly vary depending on the local batch size, despite a constant effective batch size."'
    " (trl/trainer/grpo_config.py:249-252)",
    "entropy": '"The adaptive controller below tracks a window-global token-weighted mean, which'
    ' can differ from this per-micro-batch mean when token counts vary across micro-batches."'
    " (trl/trainer/grpo_trainer.py:3196-3197, on the entropy bonus)",
}
"""What TRL 1.16 writes of the terms that depend on the cut; the report quotes it."""
LEARNING_RATE = 1.0
SEED = 0
WEIGHT_SCALE = 20.0
"""The model's weight matrices are GPT-2's initialization times this: gradients well above
the rounding of the update read back as ``new - old``."""
_WORDS = ["[PAD]", "[EOS]", "[UNK]", "q"] + [f"p{p}" for p in range(len(COMPLETION_LENGTHS))]
_WORDS += [f"c{i}" for i in range(len(COMPLETION_LENGTHS) * NUM_GENERATIONS)]
_EXPECTED_WARNINGS = (  # TRL 1.16's own notices, left out of the audit's output
    "You are using 'rollout_func'",  # an experimental feature (the audit's way in)
    "`is_gradient_checkpointing` is deprecated",  # TRL's call into transformers 5.24
)
_SETTINGS = {  # GRPOConfig: one SGD step of the policy term, deterministic, on the CPU
    "num_generations": NUM_GENERATIONS, "max_completion_length": MAX_COMPLETION_LENGTH,
    "max_steps": 1, "optim": "sgd", "learning_rate": LEARNING_RATE,
    "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0,
    "max_grad_norm": 0.0, "beta": 0.0, "epsilon": 0.2, "temperature": 1.0,
    "scale_rewards": "group", "shuffle_dataset": False, "seed": SEED, "disable_dropout": True,
    "activation_checkpointing": False, "use_cpu": True, "bf16": False, "fp16": False,
    "report_to": "none", "logging_strategy": "no", "save_strategy": "no", "disable_tqdm": True,
    "dataloader_num_workers": 0, "ddp_find_unused_parameters": False,
}  # fmt: skip


class GRPOCut(NamedTuple):
    """A cut of the audited update: ``GRPOConfig``'s window settings and the loss.

    ``epsilon_high`` None: `CISPO_EPSILON_HIGH` for cispo, else TRL's default (``epsilon``).
    """

    loss_type: str
    gradient_accumulation_steps: int
    steps_per_generation: int | None = None
    world_size: int = 1
    entropy_coef: float = 0.0
    epsilon_high: float | None = None

    @property
    def name(self) -> str:
        """``"GA=4 x spg=8 x R=2"``."""
        k, spg, ranks = self.gradient_accumulation_steps, self.steps_per_generation, self.world_size
        return f"GA={k} x spg={spg} x R={ranks}"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)  # the summary as repr, as its base
class GRPOInvarianceReport(bigbatch.InvarianceReport):
    """`bigbatch.InvarianceReport` of one cut of TRL's GRPO update, and what TRL saw.

    The cells of ``weights`` and ``row_items`` are the window's sequences (in the
    one-batch run's order), each with the gradient of its policy term
    ``sum_t -A_i log p_it`` (at ratio 1), then, with ``entropy_coef``, the same
    sequences with that of their entropy bonus ``sum_t -entropy_coef H_it``.

    Attributes (beyond `bigbatch.InvarianceReport`'s):
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
        model, pool = _tiny_gpt2(), _rollouts()
        plans = [(_one_batch_run(cut, pool), _cut_run(cut, pool)) for cut in cuts]
        unique = {_key(*run): run for plan in plans for run in plan}  # a shared run runs once
        results = {}
        for ranks in sorted({ranks for ranks, _ in unique.values()}):
            keys = [key for key, (r, _) in unique.items() if r == ranks]
            runs = [unique[key][1] for key in keys]
            done = run_trainers(runs, model, world_size=ranks, timeout_s=timeout_s, what="GRPO")
            results.update(zip(keys, done, strict=True))
        return [
            _report(cut, model, results[_key(*one)], results[_key(*cut_run)], progress)
            for cut, (one, cut_run) in zip(cuts, plans, strict=True)
        ]


def check_cut(
    loss_type: Any,
    gradient_accumulation_steps: Any,
    steps_per_generation: Any = None,
    world_size: Any = 1,
    entropy_coef: Any = 0.0,
    epsilon_high: Any = None,
) -> GRPOCut:
    """The cut with its defaults resolved; a ``ValueError`` naming the argument otherwise."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    k, ranks = gradient_accumulation_steps, world_size
    for name, value in (("gradient_accumulation_steps", k), ("world_size", ranks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if WINDOW_ROWS % (k * ranks) or (WINDOW_ROWS // ranks) % NUM_GENERATIONS:
        raise ValueError(
            f"gradient_accumulation_steps, world_size: expected GA x R to divide the update's"
            f" {WINDOW_ROWS} rows, each rank's share a multiple of {NUM_GENERATIONS} (whole"
            f" prompt groups), got GA={k!r}, R={ranks!r}"
        )
    spg = k if steps_per_generation is None else steps_per_generation
    if spg not in (k, 2 * k) or isinstance(spg, bool):
        raise ValueError(
            f"steps_per_generation: expected None, GA ({k}) or 2 GA ({2 * k}), got"
            f" {steps_per_generation!r}"
        )
    if isinstance(entropy_coef, bool) or not isinstance(entropy_coef, int | float):
        raise ValueError(f"entropy_coef: expected a finite number, got {entropy_coef!r}")
    if not math.isfinite(entropy_coef):
        raise ValueError(f"entropy_coef: expected a finite number, got {entropy_coef!r}")
    if epsilon_high is None and loss_type == "cispo":
        epsilon_high = CISPO_EPSILON_HIGH
    if epsilon_high is not None and not (
        isinstance(epsilon_high, int | float) and epsilon_high > 0
    ):
        raise ValueError(f"epsilon_high: expected None or a number > 0, got {epsilon_high!r}")
    return GRPOCut(loss_type, k, spg, ranks, float(entropy_coef), epsilon_high)


# ---- the rows and the model ---------------------------------------------------------------------


def _tokenizer() -> Any:
    """A word-level tokenizer built in memory (no download): `_WORDS`, split at spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(_WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )


def _tiny_gpt2() -> nn.Module:
    """A GPT-2 of 1 layer, width 16, random weights (seeded; the global RNG is left alone)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    pad, eos = _WORDS.index("[PAD]"), _WORDS.index("[EOS]")
    config = GPT2Config(
        vocab_size=len(_WORDS), n_positions=32, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=eos, eos_token_id=eos,
        pad_token_id=pad,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(WEIGHT_SCALE)
    return model


def _rollouts() -> dict[str, list]:
    """Every prompt's completions (token ids, `COMPLETION_LENGTHS` long, all different: the
    first token is the row's own) and rewards, row ``p G + j`` for generation ``j`` of ``p``."""
    rng = np.random.default_rng(SEED)
    words = [_WORDS.index(f"c{i}") for i in range(len(COMPLETION_LENGTHS) * NUM_GENERATIONS)]
    completions, rewards = [], []
    for lengths in COMPLETION_LENGTHS:
        rewards += rng.permutation([0.0, 1.0, 2.0, 4.0]).tolist()
        for n in lengths:
            completions.append([words[len(completions)], *rng.choice(words, n - 1).tolist()])
    return {"completions": completions, "rewards": rewards}


def _first_update_prompts(cut: GRPOCut) -> list[int]:
    """The prompts of the cut's first update: the first ``GA x B`` rows of each rank's share
    of the generation batch (rank ``r`` holds its ``r``-th consecutive share)."""
    k, spg, ranks = cut.gradient_accumulation_steps, cut.steps_per_generation, cut.world_size
    share = WINDOW_ROWS * spg // (k * ranks * NUM_GENERATIONS)  # prompts per rank
    first = WINDOW_ROWS // (ranks * NUM_GENERATIONS)
    return [rank * share + p for rank in range(ranks) for p in range(first)]


def _run(cut: GRPOCut, pool: dict, prompts: list[int], k: int, spg: int, ranks: int):
    """``(world size, TrainerRun)``: GRPOTrainer with ``k``, ``spg`` on ``prompts``."""
    settings = {
        **_SETTINGS,
        "per_device_train_batch_size": WINDOW_ROWS // (k * ranks),
        "gradient_accumulation_steps": k,
        "steps_per_generation": spg,
        "loss_type": cut.loss_type,
        "epsilon_high": cut.epsilon_high,
        "entropy_coef": cut.entropy_coef,
        "importance_sampling_level": "sequence" if cut.loss_type == "luspo" else "token",
    }
    data = {**pool, "prompts": prompts}
    return ranks, TrainerRun(_grpo_trainer, "trl.GRPOConfig", settings, data, _EXPECTED_WARNINGS)


def _one_batch_run(cut: GRPOCut, pool: dict):
    """The reference: GA=1 x spg=1 x R=1 on the rows of the cut's first update."""
    return _run(cut, pool, _first_update_prompts(cut), 1, 1, 1)


def _cut_run(cut: GRPOCut, pool: dict):
    """The cut: its settings on the prompts of its generation batch."""
    k, spg = cut.gradient_accumulation_steps, cut.steps_per_generation
    prompts = list(range(WINDOW_ROWS * spg // (k * NUM_GENERATIONS)))
    return _run(cut, pool, prompts, k, spg, cut.world_size)


def _key(ranks: int, run: TrainerRun) -> tuple:
    return ranks, tuple(sorted(run.settings.items())), tuple(run.data["prompts"])


# ---- the trainer (in this process or in a rank) -------------------------------------------------


def _grpo_trainer(model: nn.Module, args: Any, data: dict) -> tuple[Any, list]:
    """The `TrainerRun` factory: the recording GRPOTrainer on ``data["prompts"]``, whose
    ``rollout_func`` hands in the pool's completions and whose reward is the pool's."""
    from datasets import Dataset
    from transformers import PrinterCallback

    tokenizer, completions = _tokenizer(), data["completions"]
    rewards = {
        (f"p{row // NUM_GENERATIONS} q", tuple(c)): r
        for row, (c, r) in enumerate(zip(completions, data["rewards"], strict=True))
    }

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, list]:
        # this rank's share of the generation batch: each prompt NUM_GENERATIONS times in a row
        seen, out = Counter(), {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:
            row = int(prompt.split()[0][1:]) * NUM_GENERATIONS + seen[prompt]
            seen[prompt] += 1
            out["prompt_ids"].append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            out["completion_ids"].append(completions[row])
            out["logprobs"].append([0.0] * len(completions[row]))  # vLLM's; unused here
        return out

    def reward_func(prompts, completions, completion_ids, **kwargs) -> list[float]:
        return [rewards[(p, tuple(c))] for p, c in zip(prompts, completion_ids, strict=True)]

    trainer = _recording_trainer_class()(
        model=model, reward_funcs=reward_func, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": [f"p{p} q" for p in data["prompts"]]}),
        rollout_func=rollout_func,
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the final metrics line
    return trainer, trainer.audit_records


@functools.cache
def _recording_trainer_class() -> type:
    """``trl.GRPOTrainer`` that records each micro-batch's rows and does not shuffle them."""
    import trl
    from trl.trainer import grpo_trainer

    class RecordingGRPOTrainer(trl.GRPOTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.audit_records: list[dict] = []  # one per micro-batch, in order
            super().__init__(*args, **kwargs)

        def _send_telemetry(self) -> None:  # the audit reaches no network
            return None

        def _prepare_inputs(self, generation_batch: dict) -> dict:
            with _unshuffled(grpo_trainer):
                return super()._prepare_inputs(generation_batch)

        def _compute_loss(self, model: nn.Module, inputs: dict) -> torch.Tensor:
            self.audit_records.append(_record(inputs))
            return super()._compute_loss(model, inputs)

    return RecordingGRPOTrainer


@contextlib.contextmanager
def _unshuffled(grpo_trainer: Any) -> Iterator[None]:
    """TRL's ``shuffle_sequence_dict`` (as ``grpo_trainer`` calls it) left out in the body."""
    shuffle = grpo_trainer.shuffle_sequence_dict
    grpo_trainer.shuffle_sequence_dict = lambda batch: batch
    try:
        yield
    finally:
        grpo_trainer.shuffle_sequence_dict = shuffle


def _record(inputs: dict) -> dict:
    """A micro-batch as ``_compute_loss`` gets it: its rows (without padding), their
    advantages, ``num_items_in_batch``, whether old log-probabilities were computed."""
    rows = lambda ids, mask: [i[m.bool()].tolist() for i, m in zip(ids, mask, strict=True)]
    return {
        "prompts": rows(inputs["prompt_ids"], inputs["prompt_mask"]),
        "completions": rows(inputs["completion_ids"], inputs["completion_mask"]),
        "advantages": inputs["advantages"].reshape(-1).tolist(),
        "num_items_in_batch": float(inputs["num_items_in_batch"]),
        "old_logps": inputs.get("old_per_token_logps") is not None,
    }


# ---- the report ---------------------------------------------------------------------------------


def _report(
    cut: GRPOCut, model: nn.Module, one: TrainerResult, cut_result: TrainerResult, progress: bool
) -> GRPOInvarianceReport:
    """Both runs' updates, the cells' gradients, `bigbatch.invariance_report` and TRL's view."""
    (record,) = one.records[0]  # one micro-batch on one rank
    rows = list(zip(record["prompts"], record["completions"], record["advantages"], strict=True))
    expected = [p for p in _first_update_prompts(cut) for _ in range(NUM_GENERATIONS)]
    if [int(_WORDS[prompt[0]][1:]) for prompt, _, _ in rows] != expected:
        raise RuntimeError(f"GRPOTrainer: the one-batch run read other prompts than {expected}")
    microbatches = _microbatches(cut_result.records, rows)
    tokens = np.array([len(completion) for _, completion, _ in rows], np.float64)
    grads = _cell_gradients(model, rows, cut.entropy_coef)
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
        row_grad=grads.__getitem__, progress=progress,
    )  # fmt: skip
    big = [-LEARNING_RATE / tokens.sum() * sum(leaves) for leaves in zip(*grads, strict=True)]
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
    model: nn.Module, rows: list[tuple], entropy_coef: float
) -> list[list[np.ndarray]]:
    """Each row's gradient of ``sum_t -A log p_t`` (the policy term at ratio 1), then, with
    ``entropy_coef``, each row's of ``sum_t -entropy_coef H_t``; float32 leaves."""
    params, policy, entropy = _parameters(model), [], []
    for prompt, completion, advantage in rows:
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # temperature 1
        token_logp = logp.gather(-1, torch.tensor(completion)[:, None]).sum()
        policy.append(
            _numpy(torch.autograd.grad(-advantage * token_logp, params, retain_graph=True))
        )
        if entropy_coef:
            h = -(logp.exp() * logp).sum()
            entropy.append(_numpy(torch.autograd.grad(-entropy_coef * h, params)))
    return policy + entropy


def _relative(update: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """``|update - reference| / |reference|`` over every leaf, float64."""
    gap = math.fsum(float(np.sum(np.square(u - r))) for u, r in zip(update, reference, strict=True))
    return math.sqrt(gap / math.fsum(float(np.sum(np.square(r))) for r in reference))
