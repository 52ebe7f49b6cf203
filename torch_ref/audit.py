"""Audit your own PyTorch accumulation loop: how does it weigh each micro-batch and rank?

The twin of ``jaxaccum.audit`` (``docs/audit.md``). With plain SGD the update of
one window is ``delta = -lr * g``, and every known accumulation bug computes
``g`` as a reweighting of the gradients of the cells' summed losses (a cell:
one micro-batch on one rank)::

    g = sum_c w_c * G_c,        the big batch: w_c = 1 / N for every cell

:func:`audit_window` lays your rows out into cells that differ strongly in
items (``bigbatch.layout_rows``), runs your loop for one update with
``torch.optim.SGD`` (on ``world_size`` gloo ranks under
``DistributedDataParallel`` when ``world_size > 1``, `torch_ref.ddp.run`),
computes each ``G_c`` with autograd of a reference summed loss, and hands the
rest to ``bigbatch`` (the fit, the verdict, the report: the same as JAX's).
:func:`audit_hf_trainer` does the same for a Hugging Face ``transformers.Trainer``.
:func:`audit_invariance` asks the question without a reference loss: is the update
the same for every cut of the window into micro-batches and ranks?
:func:`audit_trl_grpo` asks it of TRL's ``GRPOTrainer``, for any loss type, gradient
accumulation, ``steps_per_generation`` and world size (``docs/trl-invariance.md``).
"""

import bigbatch
from torch_ref._audit_invariance import audit_invariance
from torch_ref._audit_trainer import audit_hf_trainer, hf_causal_lm_loss_sum
from torch_ref._audit_trl import audit_trl_grpo, audit_trl_grpo_cuts
from torch_ref._audit_trl_cut import GRPOCut
from torch_ref._audit_trl_report import GRPOInvarianceReport
from torch_ref._audit_window import audit_window

AuditReport = bigbatch.AuditReport

InvarianceReport = bigbatch.InvarianceReport

__all__ = [
    "AuditReport",
    "GRPOCut",
    "GRPOInvarianceReport",
    "InvarianceReport",
    "audit_hf_trainer",
    "audit_invariance",
    "audit_trl_grpo",
    "audit_trl_grpo_cuts",
    "audit_window",
    "hf_causal_lm_loss_sum",
]
