"""Constants the launchers and the kernels share, in a module that imports nothing,
so that the launchers use them without importing Triton (the kernels bind them as
``tl.constexpr``)."""

# log2(e): the kernels' softmax runs in base 2 (``exp2``), so scores are scaled by
# ``scale * LOG2_E`` and a natural-log log-sum-exp times it is in log2 units.
LOG2_E = 1.4426950408889634
# ln(2) = 1 / LOG2_E: a log-sum-exp kept in log2 units times it is the natural one.
LN_2 = 0.6931471805599453

# How a kernel masks the window along one axis (its ``MASK_T/H/W``;
# ``launch.mask_modes`` picks):
MASK_PER_STEP = 0  # compare positions on every step (the plain mask)
MASK_BITS = 1      # on every step, from per-query window bits shifted to the step
MASK_FIXED = 2     # once per program: the scan never moves along this axis
MASK_NONE = 3      # never: the axis is block-sparse for the call (launch.block_sparse_axes)

# Flags a program of a kernel's second launch (``REDO``) reads at once.
FLAG_BLOCK = 256
