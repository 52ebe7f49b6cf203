"""The big-batch math in plain numpy, shared by jaxaccum and torch_ref.

The vocabulary of a window's record (``SkipReason``, ``RECORD_KEYS``), and an
audit of an accumulation loop, framework-free: the weight each known bug
gives an item of each cell (one micro-batch on one device), the layout of a
user's rows into cells that differ strongly in items, the least-squares fit of
the weights a loop's SGD update gives the cells, and the report. The framework
code (``jaxaccum.audit``) only runs the loop and differentiates the reference
loss per cell. The method and its limits: ``docs/audit.md``.

    layout = layout_rows(row_items, k=4, num_devices=2)
    check_sums(loss_sum, num_items, row_losses, row_items)  # the loss adds up over rows
    check_layout(layout)                           # the rows can tell the bugs apart
    products = cell_products(cell_grad, update, layout, learning_rate=1.0)  # streamed
    report = audit_update(products, layout, learning_rate=1.0, max_grad_norm=None)
    assert report.passed, report

Imports numpy (and tqdm for the progress bar) only.
"""

from bigbatch._checks import (
    audit_layout,
    check_cuts,
    check_layout,
    check_learning_rate,
    check_max_grad_norm,
    check_precision,
    check_sums,
    check_window,
    refuse_row_items_with_loss_fn,
    row_items_of,
)
from bigbatch._fit import audit_update
from bigbatch._forms import (
    BUG_NAMES,
    CLIP_FORMS,
    CLIPPED_PER_MICRO_BATCH,
    COUNT_FORMS,
    EXACT,
    FIXES,
    FORM_NAMES,
    FORMULAS,
    MEAN_OF_GLOBAL_MEANS,
    MEAN_OF_MEANS,
    UNKNOWN,
    WHAT_IT_DOES,
    checkable_forms,
    form_weights,
)
from bigbatch._invariance import INVARIANCE_RTOL, InvarianceReport, invariance_report
from bigbatch._layout import CellLayout, first_labels_of, layout_rows, tail_microbatches
from bigbatch._products import (
    CELL_MEMORY,
    CellProducts,
    cell_products,
    parameter_change,
    stream_products,
)
from bigbatch._records import IGNORE_INDEX, RECORD_KEYS, SkipReason
from bigbatch._repeat import (
    LR_SCALE,
    check_proportional,
    sample,
    sampled_change,
    sampled_rounding,
    warm_up_micro_batch,
    warm_up_note,
)
from bigbatch._report import AuditReport
from bigbatch._tolerances import (
    CLIP_RTOL,
    FIT_NOISE,
    ITEMS_RTOL,
    LINEAR_RTOL,
    LOSS_RTOL,
    MAX_CONDITION,
    MAX_ROUNDING,
    RESIDUAL_RTOL,
    SEPARATION,
    WEIGHT_RTOL,
)

__all__ = [
    "BUG_NAMES",
    "CELL_MEMORY",
    "CLIPPED_PER_MICRO_BATCH",
    "CLIP_FORMS",
    "CLIP_RTOL",
    "COUNT_FORMS",
    "EXACT",
    "FIT_NOISE",
    "FIXES",
    "FORMULAS",
    "FORM_NAMES",
    "IGNORE_INDEX",
    "INVARIANCE_RTOL",
    "ITEMS_RTOL",
    "LINEAR_RTOL",
    "LR_SCALE",
    "LOSS_RTOL",
    "MAX_CONDITION",
    "MEAN_OF_GLOBAL_MEANS",
    "MEAN_OF_MEANS",
    "RECORD_KEYS",
    "MAX_ROUNDING",
    "RESIDUAL_RTOL",
    "SEPARATION",
    "UNKNOWN",
    "WEIGHT_RTOL",
    "WHAT_IT_DOES",
    "AuditReport",
    "CellLayout",
    "CellProducts",
    "InvarianceReport",
    "SkipReason",
    "audit_layout",
    "audit_update",
    "check_layout",
    "check_learning_rate",
    "check_max_grad_norm",
    "check_precision",
    "check_proportional",
    "sample",
    "sampled_change",
    "sampled_rounding",
    "warm_up_micro_batch",
    "warm_up_note",
    "check_sums",
    "check_window",
    "cell_products",
    "check_cuts",
    "checkable_forms",
    "first_labels_of",
    "form_weights",
    "invariance_report",
    "layout_rows",
    "parameter_change",
    "refuse_row_items_with_loss_fn",
    "row_items_of",
    "stream_products",
    "tail_microbatches",
]
