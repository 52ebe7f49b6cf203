"""The audit's tolerances (relative), and why.

* ``RESIDUAL_RTOL = 1e-3``: float32 gradients and the float32 update read
  back as ``new - old`` put a reweighting's residual at ~1e-6; a loop that is
  no reweighting (Adam's first step is nearly ``sign(g)``, an elementwise
  clip) leaves residuals of percents or more.
* ``WEIGHT_RTOL = 1e-3``: the recovered weights of a float32 loop are within
  ~1e-6 of their formula, times the fit's amplification (the condition number
  of the cells' gradients, at most ``MAX_CONDITION``; 2 to 4 on the tests'
  tiny models).
* ``SEPARATION = 0.05``: the audit refuses a batch whose layout does not make
  every checkable bug differ from the big batch by at least 5% in some cell,
  50x the weight tolerance, so that no bug can pass for the big batch. (Bugs
  that weigh the window alike are all listed in ``matches``.)
* ``MAX_CONDITION = 1e4``: beyond it float32 noise (~1e-7) could move the
  weights by ~1e-3, the tolerance.
* ``MAX_ROUNDING = 1e-4``: the update is read back in the parameters' dtype;
  its rounding must stay 10x below the residual tolerance.
* ``ITEMS_RTOL = 1e-6``, ``LOSS_RTOL = 1e-4``: the reference loss of a batch
  against the sum over its rows (``check_sums``): the items are counts (exact
  in float32 up to 2**24), the float32 loss sums add the same numbers in
  another order (~1e-6); a mean instead of a sum is off by ~1.
* ``CLIP_RTOL = 1e-3``: a clipped gradient's norm against the ``max_grad_norm``
  you passed. The norm is read off the float32 update (~1e-6), and the clip
  factors differ by a little: optax's ``c / |g|`` gives the norm ``c``,
  PyTorch's (and jaxaccum's) ``c / (|g| + 1e-6)`` gives ``c (1 - 1e-6 / |g|)``,
  within 1e-3 of ``c`` for any gradient norm above 1e-3.
"""

from __future__ import annotations

RESIDUAL_RTOL = 1e-3
WEIGHT_RTOL = 1e-3
SEPARATION = 0.05
MAX_CONDITION = 1e4
MAX_ROUNDING = 1e-4
ITEMS_RTOL = 1e-6
LOSS_RTOL = 1e-4
CLIP_RTOL = 1e-3
