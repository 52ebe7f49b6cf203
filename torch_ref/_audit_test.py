"""The torch audit recovers how torch_ref's variants, nanoGPT's loop and the HF Trainer weigh cells.

Every loop runs one SGD update of a small ``TinyGPT`` on the audit's layout of
the same rows (`tinygpt.torch_testing.skewed_batch`: a row with ``n`` valid tokens,
a masked prompt before them). The expected weights are the formulas of
``docs/math.md`` (``bigbatch.form_weights``); the layouts are the JAX audit's
(``bigbatch.layout_rows``), so the items per cell are those of
``jaxaccum/_audit_test.py`` for the same token counts.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import bigbatch
from tinygpt import TinyGPTConfig, torch_testing
from tinygpt.torch_gpt import TinyGPT
from tinygpt.torch_testing import skewed_batch
from torch_ref import IGNORE_INDEX, buggy, causal_lm_loss_sum, train_update
from torch_ref.audit import audit_hf_trainer, audit_window

pytestmark = pytest.mark.slow  # every audit runs a loop (processes, transformers): make test only

# The weights of a float32 loop come out within ~1e-7 (relative) of their formula
# (float32 gradients summed in another order, the update read back as new - old, times
# the fit's condition number, 1.8 to 3.9 here; measured 4e-8 to 1e-7); 1e-4 is the JAX
# audit test's margin, 1000x that, and still 500x below the 5% that separates two forms.
WEIGHT_RTOL = 1e-4
# A reweighting's relative residual is float32 rounding (measured 2e-7 to 7e-7; 2.3e-6
# for the per-micro-batch clip); 1e-4 is the same margin (bigbatch.RESIDUAL_RTOL is 1e-3).
RESIDUAL_MAX = 1e-4
# |update - big-batch update| / |big-batch update| of a correct float32 loop: 2.5e-7 to
# 3.6e-7 measured (the same rounding, no fit); 1e-5 leaves 30x room.
UPDATE_RTOL = 1e-5
SEQ_LEN = 12
K = 4  # micro-batches per window; the audit's short window has 2
CONFIG = TinyGPTConfig(vocab_size=32, block_size=SEQ_LEN, n_layer=1, n_head=2, d_model=16)
MODEL = TinyGPT(CONFIG, seed=0)


def rows(tokens: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch of ``len(tokens)`` rows; row ``i`` holds ``tokens[i]`` valid (shifted) labels."""
    ids, labels = skewed_batch(seed, tuple(tokens), seq_len=SEQ_LEN, vocab_size=CONFIG.vocab_size)
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}


# 16 rows, all with tokens (a mean per micro-batch stays finite): the one-rank loops
FULL_TOKENS = [1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 11]
FULL = rows(FULL_TOKENS)
# 16 rows, four without a token: one rank's micro-batch of a data-parallel window gets none
SKEWED = rows([0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 8, 9, 10, 11], seed=1)


def loss_fn(model, batch):
    """The reference: the summed causal-LM loss and its valid tokens."""
    return causal_lm_loss_sum(model(batch["input_ids"]), batch["labels"])


def audit(window_fn, batch=FULL, **kwargs) -> bigbatch.AuditReport:
    return audit_window(window_fn, loss_fn, MODEL, batch, **kwargs)


def assert_recovers(report: bigbatch.AuditReport, name: str) -> None:
    """The verdict is ``name`` and every weight is that form's (``WEIGHT_RTOL``)."""
    assert report.verdict == name, report
    weights = bigbatch.form_weights(
        name, report.items, k=report.k, first_labels=report.first_labels
    )
    np.testing.assert_allclose(report.weights, weights, rtol=WEIGHT_RTOL)
    assert report.residual <= RESIDUAL_MAX, report  # a reweighting, to float32 rounding


def variant_window(model, optimizer, microbatches, *, name: str, **kwargs):
    """torch_ref's loop with one of its decision points flipped (`torch_ref.buggy`)."""
    train_update(model, microbatches, optimizer, variant=buggy.variant(name), nominal_k=K, **kwargs)


def variant(name: str, **kwargs):
    """A picklable ``window_fn`` (the ranks of a DDP audit unpickle it)."""
    return functools.partial(variant_window, name=name, **kwargs)


def nanogpt_window(model, optimizer, microbatches):
    """nanoGPT's train.py: a token-mean loss, ``loss / gradient_accumulation_steps``, backward."""
    for mb in microbatches:
        logits = model(mb["input_ids"])[:, :-1]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            mb["labels"][:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )
        (loss / len(microbatches)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def cell_grad(batch, ids) -> torch.Tensor:
    """The gradient of the summed loss of ``batch``'s rows ``ids``, by hand (autograd)."""
    model = TinyGPT(CONFIG, seed=0)
    loss_fn(model, {name: value[ids] for name, value in batch.items()})[0].backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()


# ---- one rank -----------------------------------------------------------------------------------


def test_hand_checked_two_microbatches_of_3_and_1_tokens():
    # N = 4. nanoGPT's mean of means weighs a token of the 1-token micro-batch 1/(2*1) = 2/N
    # and one of the 3-token micro-batch 1/(2*3) = (2/3)/N; the layout puts the short one
    # first. (The report's other numbers for these weights: jaxaccum/_audit_test.py's twin.)
    batch = rows([3, 1])
    report = audit(nanogpt_window, batch, k=2)
    np.testing.assert_array_equal(report.items, [[1.0, 3.0]])
    np.testing.assert_allclose(report.weights, [[2.0, 2.0 / 3.0]], rtol=WEIGHT_RTOL)
    assert report.verdict == "mean_of_means" and report.matches == ("mean_of_means",)
    # the distance to the big batch, by hand from autograd: the update is
    # -(G_1/2 + G_0/6), the big batch's -(G_0 + G_1)/4 (row 1 holds 1 token, row 0 three)
    g_short, g_long = cell_grad(batch, [1]), cell_grad(batch, [0])
    big = (g_short + g_long) / 4
    by_hand = float((g_short / 2 + g_long / 6 - big).norm() / big.norm())
    assert abs(report.update_error - by_hand) <= UPDATE_RTOL * by_hand  # float32 gradients
    assert "verdict: mean_of_means: each micro-batch takes its own mean" in str(report), report


def test_the_reference_loop_is_the_big_batch():
    report = audit(variant("reference"), SKEWED, k=K)
    assert_recovers(report, "exact")
    assert report.passed and report.update_error <= UPDATE_RTOL, report
    # the four rows without a token are spread: every cell holds one, and its weight is seen
    assert report.empty_cells == [] and np.all(report.items > 0)


@pytest.mark.parametrize(
    "window_fn, verdict, short_window",
    [
        (nanogpt_window, "mean_of_means", False),
        (variant("mean_of_means"), "mean_of_means", False),
        (variant("missing_1_over_k"), "missing_1_over_k", False),
        (variant("fixed_divisor_tail"), "fixed_divisor_tail", True),
        (variant("reference"), "exact", True),  # a tail normalized by its own items
        # on one rank N_r = N and R = 1: these two ARE the big batch (no form to check)
        (variant("local_denominator"), "exact", False),
        (variant("ddp_average_forgotten"), "exact", False),
        # one update at a constant LR, one rank: a schedule and no_sync are invisible
        (variant("scheduler_per_microbatch"), "exact", False),
        (variant("no_sync_backward_only"), "exact", False),
    ],
    ids=[
        "nanogpt", "mean_of_means", "missing_1_over_k", "fixed_divisor_tail", "reference_tail",
        "local_denominator", "ddp_average_forgotten", "scheduler_per_microbatch",
        "no_sync_backward_only",
    ],
)  # fmt: skip
def test_one_rank_loops_are_recovered(window_fn, verdict, short_window):
    report = audit(window_fn, k=K, short_window=short_window)
    assert_recovers(report, verdict)
    # the layout makes the micro-batches differ strongly (the JAX audit's cells, too)
    expected = [[21.0, 73.0]] if short_window else [[6.0, 15.0, 30.0, 43.0]]
    np.testing.assert_array_equal(report.items, expected)
    if verdict == "fixed_divisor_tail":
        assert abs(report.scale - 0.5) <= WEIGHT_RTOL  # k_tail / k = 2 / 4 of its gradient


def no_step_window(model, optimizer, microbatches):
    """Accumulates and forgets to step: no update."""
    for mb in microbatches:
        loss_fn(model, mb)[0].backward()


def test_a_loop_that_does_not_step_is_reported():
    report = audit(no_step_window, k=K)
    assert report.verdict == "unknown" and not report.moved
    np.testing.assert_array_equal(report.weights, np.zeros((1, K)))  # no update: exactly 0
    assert "did not change the parameters" in str(report), report


def test_the_audit_leaves_the_model_as_it_was():
    before = [p.detach().clone() for p in MODEL.parameters()]
    audit(variant("reference"), k=K)
    for old, new in zip(before, MODEL.parameters(), strict=True):
        assert torch.equal(old, new)  # the loop ran on a copy: bit for bit


# ---- DistributedDataParallel, 2 gloo ranks ------------------------------------------------------


@pytest.mark.parametrize(
    "name, verdict, scale",
    [
        ("reference", "exact", 1.0),
        ("local_denominator", "local_denominator", 1.0),  # no empty rank: sum_r N_r/(R N_r) = 1
        ("ddp_average_forgotten", "ddp_average_forgotten", 0.5),  # 1 / R
        ("mean_of_means", "mean_of_means", 1.0),  # 8 means of R k = 8 cells, all with tokens
        ("no_sync_backward_only", "exact", 1.0),  # more all-reduces, the same numbers
    ],
)
def test_ddp_variants_on_two_gloo_ranks(name, verdict, scale):
    report = audit(variant(name), SKEWED, k=K, world_size=2)
    assert_recovers(report, verdict)
    assert abs(report.scale - scale) <= WEIGHT_RTOL
    # the emptiest rows on the last rank, the next on rank 0, as in the JAX audit; the rows
    # without a token spread over the last rank's cells, one each (none left empty)
    np.testing.assert_array_equal(report.items, [[7, 11, 17, 21], [1, 2, 1, 2]])
    assert report.empty_cells == []


def unsynchronized_window(model, optimizer, microbatches):
    """Backward through the module inside DDP: no all-reduce, each rank steps alone."""
    for mb in microbatches:
        loss_sum, num_items = loss_fn(model.module, mb)
        (loss_sum / max(num_items, 1)).backward()
    optimizer.step()


def test_ranks_that_step_apart_are_refused():
    with pytest.raises(ValueError, match="rank 1's parameters differ from rank 0's"):
        audit(unsynchronized_window, SKEWED, k=K, world_size=2)


# ---- the Hugging Face Trainer -------------------------------------------------------------------


def tiny_gpt2(class_name: str = "GPT2LMHeadModel"):
    """`tinygpt.torch_testing.tiny_gpt2` over `SEQ_LEN` positions (a skip without transformers)."""
    pytest.importorskip("transformers")
    return torch_testing.tiny_gpt2(SEQ_LEN, class_name)


def hf_rows(batch) -> list[dict[str, torch.Tensor]]:
    return [{name: value[i] for name, value in batch.items()} for i in range(len(batch["labels"]))]


def test_hf_trainer_counts_the_window_on_one_process():
    # transformers 5.24: GPT-2 accepts loss kwargs, so the Trainer counts the window's tokens
    # (num_items_in_batch over its k micro-batches) and divides every micro-batch's sum by them
    report = audit_hf_trainer(tiny_gpt2(), hf_rows(SKEWED), k=K)
    assert_recovers(report, "exact")
    assert report.update_error <= UPDATE_RTOL, report


def test_hf_trainer_with_a_model_without_loss_kwargs_takes_a_mean_of_means():
    # a forward without **kwargs gets no num_items_in_batch: each micro-batch's mean, / k
    model = tiny_gpt2()
    plain = type("PlainGPT2", (type(model),), {"forward": _forward_without_kwargs})
    model.__class__ = plain
    report = audit_hf_trainer(model, hf_rows(FULL), k=K)
    assert_recovers(report, "mean_of_means")


def _forward_without_kwargs(self, input_ids=None, labels=None):
    return super(type(self), self).forward(input_ids=input_ids, labels=labels)


@pytest.mark.parametrize(
    "average_tokens_across_devices, verdict",
    [(True, "exact"), (False, "local_denominator")],  # True is the default
)
def test_hf_trainer_on_two_gloo_ranks(average_tokens_across_devices, verdict):
    # True: the window's count is gathered over the ranks and the loss times R undoes DDP's
    # mean; False: each rank divides by its own count, then DDP averages the ranks
    report = audit_hf_trainer(
        tiny_gpt2(), hf_rows(SKEWED), k=K, world_size=2,
        average_tokens_across_devices=average_tokens_across_devices,
    )  # fmt: skip
    assert_recovers(report, verdict)
    np.testing.assert_array_equal(report.items.sum(axis=1), [56, 6])


def with_first_labels(batch) -> dict[str, torch.Tensor]:
    """``batch`` with every row's label at position 0 set, as a data collator that copies
    ``input_ids`` into ``labels`` does (position 0 is never a target of the shifted loss)."""
    labels = batch["labels"].clone()
    labels[:, 0] = batch["input_ids"][:, 0]
    return {**batch, "labels": labels}


def test_hf_trainer_counts_position_0_for_gpt2_lm_head_model():
    # transformers 5.24 leaves each row's position 0 out of num_items_in_batch only for a model
    # whose loss_type is ForCausalLM, read off the class NAME: GPT2LMHeadModel's has none, so
    # the 16 first labels are counted, and every item weighs N / (N + 16) = 94 / 110
    report = audit_hf_trainer(tiny_gpt2(), hf_rows(with_first_labels(FULL)), k=K)
    assert_recovers(report, "first_label_counted")
    assert abs(report.scale - 94 / 110) <= WEIGHT_RTOL, report
    # the same model under a class name with ForCausalLM in it: counted after the shift
    model = tiny_gpt2("GPT2ForCausalLM")
    assert_recovers(audit_hf_trainer(model, hf_rows(with_first_labels(FULL)), k=K), "exact")


def mean_loss_trainer(scaled_for_ga: bool, *, use_count: bool = False):
    """A Trainer whose ``compute_loss`` returns the micro-batch's token mean (or its sum over
    ``num_items_in_batch``) and says whether it is scaled for gradient accumulation
    (``Trainer.loss_is_scaled_for_ga``, transformers 5.19)."""
    import transformers

    from torch_ref.audit import hf_causal_lm_loss_sum

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss_sum, n = hf_causal_lm_loss_sum(model, inputs)
        return loss_sum / (num_items_in_batch if use_count else max(n, 1))

    members = {"compute_loss": compute_loss, "loss_is_scaled_for_ga": scaled_for_ga}
    return type("MeanLossTrainer", (transformers.Trainer,), members)


@pytest.mark.parametrize(
    "scaled_for_ga, use_count, verdict",
    [
        (False, False, "mean_of_means"),  # the Trainer divides the mean by k: nanoGPT's loop
        (True, False, "missing_1_over_k"),  # a mean declared scaled: the 1/k is lost
        (True, True, "exact"),  # the sum over num_items_in_batch, declared scaled
    ],
)
def test_hf_trainer_loss_is_scaled_for_ga(scaled_for_ga, use_count, verdict):
    trainer_class = mean_loss_trainer(scaled_for_ga, use_count=use_count)
    report = audit_hf_trainer(tiny_gpt2(), hf_rows(FULL), k=K, trainer_class=trainer_class)
    assert_recovers(report, verdict)


# ---- arguments ----------------------------------------------------------------------------------


def mean_loss_fn(model, batch):
    """The token mean, counted as 1 item: refused, it does not add up over rows."""
    return loss_fn(model, batch)[0] / loss_fn(model, batch)[1], 1


class Dropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.dropout = torch.nn.Linear(3, 3), torch.nn.Dropout(0.1)


@pytest.mark.parametrize(
    "change, match",
    [
        # bigbatch.check_window's checks (bigbatch/_fit_test.py), naming this API's world_size
        (dict(world_size=0), "world_size: expected a positive int"),
        (dict(k=1), "k: a window of k=1 micro-batch on world_size=1 device is one cell"),
        (dict(learning_rate=1e-9), "learning_rate: the big-batch update"),  # torch's rounding
        (dict(window_fn=None), "window_fn: expected a function"),
        (dict(model=Dropout()), "model: dropout makes the update random"),
        (dict(batch={"input_ids": torch.zeros(4, 3), "labels": torch.zeros(5, 3)}), "same number"),
        (dict(batch=rows([1, 2, 3])), "batch: expected at least 4 rows"),
        (dict(batch=rows([5] * 8)), "batch: its rows are too alike"),
        (dict(batch=rows([0] * 8)), "batch: no row has an item"),
        (dict(loss_fn=mean_loss_fn), "loss_fn: expected a summed loss"),
        (dict(loss_fn=lambda m, b: loss_fn(m, b)[0]), r"loss_fn: expected \(loss_sum"),
    ],
)
def test_bad_arguments_are_refused_with_their_name(change, match):
    kwargs = dict(window_fn=nanogpt_window, loss_fn=loss_fn, model=MODEL, batch=FULL, k=K)
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        audit_window(**kwargs)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(max_grad_norm=None), "max_grad_norm: expected the number the Trainer clips"),
        (dict(optim="adamw_torch"), "training_args: the audit sets optim='sgd' itself"),
        (dict(bf16=True), "training_args: the audit sets bf16=False itself"),
        (dict(no_such_argument=1), "training_args: not arguments of"),
        (dict(rows=[{"input_ids": [1, 2], "labels": [1, 2]}] * 3
                   + [{"input_ids": [1], "labels": [1]}]),
         "rows: expected rows of one length"),
    ],
)  # fmt: skip
def test_bad_trainer_arguments_are_refused_with_their_name(change, match):
    pytest.importorskip("transformers")
    kwargs = dict(model=MODEL, rows=hf_rows(FULL), k=K)
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        audit_hf_trainer(**kwargs)
