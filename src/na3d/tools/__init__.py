"""Tools around the op, not part of it: nothing in the core package imports them.

* :mod:`na3d.tools.bench`: the benchmark (``python -m na3d.bench``);
* :mod:`na3d.tools.tune`: the offline tuner that rewrites ``configs/<arch>.json``;
* :mod:`na3d.tools.bench_decoder`: the LTX-2.5 decoder end to end (needs diffusers);
* :mod:`na3d.tools.flex_baseline`: FlexAttention with a neighborhood ``BlockMask``,
  the benchmark's baseline;
* :mod:`na3d.tools.common`: the benchmark shapes and the GPU timer they share.
"""
