"""What the benchmark and the tuner share: the benchmark shapes, the GPU timer, logging."""

from __future__ import annotations

import json
import statistics
import time
from importlib import resources
from typing import Callable, List, Optional

import torch


def log(msg: str) -> None:
    print(msg, flush=True)


SHAPE_GROUPS = ("ltx", "dit", "strided", "all")


def bench_shapes(group: str = "ltx") -> List[dict]:
    """The benchmark shapes (``bench_shapes.json``, package data): name, group, shape, kernel size.

    ``group``: ``"ltx"`` (the default) for the LTX-2.5 decoder's shapes, head dim 64,
    what the tuner, the GPU tests and the A/B scripts run on; ``"dit"`` for the
    video-DiT training shapes (head dim 128, windows of thousands of keys: too large
    for the tests' float32 oracles); ``"strided"`` for NATTEN's strided windows (rows
    with a ``stride``); ``"all"`` for every group, in the file's order.
    """
    if group not in SHAPE_GROUPS:
        raise ValueError(f"group must be one of {SHAPE_GROUPS}, got {group!r}")
    shapes = json.loads((resources.files(__package__) / "bench_shapes.json").read_text())["shapes"]
    return [s for s in shapes if group == "all" or s["group"] == group]


class Timer:
    """Median CUDA-event time of ``fn``, with L2 flushed before every run.

    ``graphs=True`` times GPU work only: ``fn`` is captured once in a CUDA graph
    after the flush, and the result is the median replay time of that graph minus
    that of a graph holding the flush alone. For calls so small that host work
    (argument checks, kernel launches) exceeds their kernels, where eager timing
    measures the host and hides differences between kernel configurations (the
    tuner's ``--graph-timing``). ``fn`` must be capturable (no host syncs).
    """

    def __init__(self, device, flush_bytes: int = 256 << 20, graphs: bool = False):
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device)
        self.graphs = graphs

    def __call__(self, fn: Callable, min_runs: int = 10, target_ms: float = 300.0,
                 max_runs: int = 200) -> float:
        fn()  # warm-up: compilation, autotuning of dependencies, allocator
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est = (time.perf_counter() - t0) * 1e3
        runs = int(min(max_runs, max(min_runs, target_ms / max(est, 1e-3))))
        if self.graphs:
            return self._graph_ms(fn, runs)

        return self._median_ms(fn, runs, before=self.flush.zero_)

    @staticmethod
    def _median_ms(fn: Callable, runs: int, before: Optional[Callable] = None) -> float:
        times = []
        for _ in range(runs):
            if before is not None:
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in times)

    def _graph_ms(self, fn: Callable, runs: int) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # capture needs a warmed-up side stream
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with_fn, flush_only = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(with_fn):
            self.flush.zero_()
            fn()
        with torch.cuda.graph(flush_only):
            self.flush.zero_()
        return self._median_ms(with_fn.replay, runs) - self._median_ms(flush_only.replay, runs)
