"""`audit_hf_trainer` as a user meets it: a window after another, your arguments, a clip.

The Trainer runs a warm-up window of other items first (a count kept from it shows), writes
nothing of yours, refuses dropout it cannot see as a module and the arguments it sets itself
by name, runs a clipped window once more without the clip, and takes ``trainer_kwargs``
(transformers 5.24, on `torch_ref._audit_test`'s tiny GPT-2 and rows).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from torch_ref._audit_test import (
    FULL,
    SEQ_LEN,
    WEIGHT_RTOL,
    K,
    assert_recovers,
    hf_rows,
    tiny_gpt2,
    with_first_labels,
)
from torch_ref.audit import audit_hf_trainer, hf_causal_lm_loss_sum

pytestmark = pytest.mark.slow  # every audit runs a Trainer (transformers): make test only

CLIP = 0.3  # below the big batch's gradient norm on FULL's rows (0.77): the clip bites


def cached_count_trainer():
    """A Trainer that divides every window by the count of the FIRST window it saw (a
    normalizer cached at the first step): right on a fresh Trainer's first update only."""
    import transformers

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.first_count is None:
            self.first_count = num_items_in_batch
        return hf_causal_lm_loss_sum(model, inputs)[0] / self.first_count

    members = {"compute_loss": compute_loss, "loss_is_scaled_for_ga": True, "first_count": None}
    return type("CachedCountTrainer", (transformers.Trainer,), members)


def test_hf_trainer_audits_the_update_after_a_warm_up_window():
    # the warm-up window is the micro-batch with the most items k times: k * 43 = 172 items;
    # the audited window's N = 94 divided by 172 weighs every item 94 / 172 = 0.547x
    report = audit_hf_trainer(tiny_gpt2(), hf_rows(FULL), k=K, trainer_class=cached_count_trainer())
    assert report.verdict == "unknown" and not report.passed, report
    warm_up_items = K * float(report.items.max())
    assert warm_up_items == 172
    assert abs(report.scale - 94 / warm_up_items) <= WEIGHT_RTOL, report


def test_hf_trainer_writes_nothing_into_your_output_dir(tmp_path):
    out = tmp_path / "yours"
    report = audit_hf_trainer(
        tiny_gpt2(), hf_rows(FULL), k=K, output_dir=str(out), save_strategy="steps", save_steps=1
    )
    assert report.verdict == "exact" and report.passed, report
    assert not out.exists()  # the audit's own temporary output_dir, no checkpoint


def tiny_llama(attention_dropout: float):
    """A randomly initialized Llama whose attention dropout is functional (no nn.Dropout)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
        attention_dropout=attention_dropout,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_hf_trainer_refuses_dropout_that_is_no_module():
    with pytest.raises(ValueError, match=r"model: LlamaForCausalLM gives other logits .*"
                       r"dropout \(attention_dropout=0.1\) makes the update random"):  # fmt: skip
        audit_hf_trainer(tiny_llama(0.1), hf_rows(FULL), k=K)


def test_hf_trainer_audits_a_llama_without_dropout():
    assert_recovers(audit_hf_trainer(tiny_llama(0.0), hf_rows(FULL), k=K), "exact")


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(gradient_accumulation_steps=8), "pass k=8 instead of gradient_accumulation_steps=8"),
        (dict(per_device_train_batch_size=2),
         r"16 // \(4 \* 1\) = 4; for per_device_train_batch_size=2 give"
         r" k \* world_size \* 2 rows = 8"),
        (dict(rows=hf_rows(FULL)[:3]),
         r"rows: expected at least k \* world_size = 4 \* 1 = 4 rows"),
        (dict(max_grad_norm=None),
         r"max_grad_norm: expected the number the Trainer clips .* got None"),
        (dict(max_steps=1), "training_args: the audit sets max_steps=2 itself"),
        (dict(dataloader_num_workers=1), "training_args: the audit sets dataloader_num_workers=0"),
        (dict(accelerator_config={"split_batches": True}),
         "accelerator_config: expected split_batches False or unset"),
        (dict(accelerator_config={"dispatch_batches": True}),
         "accelerator_config: expected dispatch_batches False or unset"),
        (dict(trainer_kwargs={"optimizers": (None, None)}),
         r"trainer_kwargs: the audit passes \['optimizers'\] itself"),
    ],
)  # fmt: skip
def test_trainer_arguments_the_audit_sets_are_refused_with_what_to_pass(change, match):
    kwargs = dict(model=tiny_gpt2(), rows=hf_rows(FULL), k=K)
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        audit_hf_trainer(**kwargs)


def test_hf_trainer_reads_max_grad_norm_below_0_as_no_clip():
    # the Trainer clips only for max_grad_norm > 0: -1 is an unclipped window, as math.inf
    report = audit_hf_trainer(tiny_gpt2(), hf_rows(FULL), k=K, max_grad_norm=-1.0)
    assert report.verdict == "exact" and report.passed, report
    assert report.max_grad_norm == math.inf and report.clip_scale == 1.0


def test_hf_trainer_audits_a_clipped_window_once_more_without_the_clip():
    # GPT2LMHeadModel counts the 16 first labels (N / (N + 16) = 94 / 110): a constant factor
    # the clip to 0.3 erases; the run without the clip names it
    rows = hf_rows(with_first_labels(FULL))
    report = audit_hf_trainer(tiny_gpt2(), rows, k=K, max_grad_norm=CLIP)
    assert_recovers(report, "first_label_counted")
    assert abs(report.scale - 94 / 110) <= WEIGHT_RTOL and not report.passed, report
    note = str(report).splitlines()[-1]  # the clipped run read exact: the clip hid 94 / 110
    assert note.startswith("the report above is the Trainer's update without the clip"), note
    assert 'max_grad_norm=0.3 it read "PASSED, exact' in note, note
    # counted after the shift (a ForCausalLM class name): exact with and without the clip
    report = audit_hf_trainer(tiny_gpt2("GPT2ForCausalLM"), rows, k=K, max_grad_norm=CLIP)
    assert report.verdict == "exact" and report.passed and report.clip_scale < 1, report
    assert "without the clip (max_grad_norm=0): PASSED, exact" in str(report)


def micro_batch_mean(outputs, labels, num_items_in_batch=None):
    """A ``compute_loss_func`` that returns its micro-batch's token mean (the count unused)."""
    logits, targets = outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    return F.cross_entropy(logits, targets, ignore_index=-100)


def test_hf_trainer_takes_trainer_kwargs():
    # transformers 5.24 counts a compute_loss_func's loss as scaled for gradient accumulation:
    # a mean per micro-batch is then not divided by k
    report = audit_hf_trainer(
        tiny_gpt2(), hf_rows(FULL), k=K, trainer_kwargs={"compute_loss_func": micro_batch_mean}
    )
    assert_recovers(report, "missing_1_over_k")
