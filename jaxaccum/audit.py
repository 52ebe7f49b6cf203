"""Audit your own accumulation loop: how does it weigh each micro-batch and device?

:func:`audit_window` runs your code for one SGD update on a layout of your rows
into cells (a cell: one micro-batch on one device), differentiates a reference
summed loss per cell with ``jax.grad``, and lets ``bigbatch`` fit the weight your
update gives each cell and name the known bug they match. The method, its
tolerances and its cost: ``docs/audit.md``. :func:`audit_invariance` asks without
a reference loss: is the update the same for every cut of the window?
:func:`check_big_batch` compares one window's update, taken from your own run,
with the big batch's.
"""

import bigbatch
from jaxaccum._audit_invariance import audit_invariance
from jaxaccum._audit_window import audit_window
from jaxaccum._big_batch_check import BIG_BATCH_RTOL, BigBatchCheck, check_big_batch

AuditReport = bigbatch.AuditReport
InvarianceReport = bigbatch.InvarianceReport

__all__ = [
    "BIG_BATCH_RTOL",
    "AuditReport",
    "BigBatchCheck",
    "InvarianceReport",
    "audit_invariance",
    "audit_window",
    "check_big_batch",
]
