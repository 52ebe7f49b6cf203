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
* ``LINEAR_RTOL = 1e-5``: your loop's update at ``LR_SCALE`` (1024) x the learning rate,
  over ``LR_SCALE``, against
  its update (`_repeat.py`), beyond the rounding of reading both back: the same
  float32 gradients in the same order give the same numbers (~1e-7 where a device
  adds in its own order); stepping per micro-batch differs by ``lr`` x the loss's
  curvature, 1e-4 and more where the fit still reads the big batch.
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
"""The largest residual ``|e| / |delta / lr|`` of a reweighting: float32 rounding leaves ~1e-6,
a loop that is no reweighting percents."""
WEIGHT_RTOL = 1e-3
"""The largest relative distance of a recovered weight from its form's."""
SEPARATION = 0.05
"""The least relative difference from the big batch that the layout gives every checkable bug."""
FIT_NOISE = 1e-5
"""The largest distance of a float32 loop's weights from its own form (measured ~1e-7 to
1e-6): a form further off that another fits 10x better is not the verdict."""
MAX_CONDITION = 1e4
"""The largest condition number of the cells' gradients the fit accepts."""
MAX_ROUNDING = 1e-4
"""The largest relative rounding of the update read back in the parameters' dtype."""
LINEAR_RTOL = 1e-5
"""The largest relative difference of your loop's update at ``LR_SCALE`` x the learning rate,
over ``LR_SCALE``, from its update (beyond the rounding of reading them back)."""
ITEMS_RTOL = 1e-6
"""The largest relative difference of the batch's items from the sum over its rows."""
LOSS_RTOL = 1e-4
"""The largest relative difference of the batch's loss from the sum over its rows."""
CLIP_RTOL = 1e-3
"""The largest relative distance of a clipped gradient's norm from ``max_grad_norm``."""
