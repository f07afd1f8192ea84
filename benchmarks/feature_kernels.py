"""Per-kernel GPU time of each feature call against the plain call (the benchmark's
``--features`` inputs), to say which kernel a feature's extra time goes to.

    PYTHONPATH=src python benchmarks/feature_kernels.py [--bases feature-base] [--runs 10]

Prints, per base shape, feature and pass, each GPU kernel's name, launches per call and
microseconds per call (torch.profiler, after warm-up runs), the plain call's beside it.
"""

import argparse
import collections

import torch

from na3d.tools import bench


def kernel_times(run, runs: int) -> dict:
    """name -> (launches per call, microseconds per call) of the GPU kernels ``run()`` issues."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            run()
        torch.cuda.synchronize()
    count, micros = collections.Counter(), collections.Counter()
    for event in prof.events():
        if bench.is_kernel_event(event):
            name = event.name[:60]
            count[name] += 1
            micros[name] += event.time_range.elapsed_us()
    return {n: (count[n] / runs, micros[n] / runs) for n in count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bases", nargs="*", default=None)
    parser.add_argument("--features", nargs="*", default=list(bench.FEATURES))
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    for spec in bench.feature_bases(args.bases):
        for feature in args.features:
            if bench.feature_skip_reason(spec, bench.FEATURES[feature]):
                continue
            for pas in ("fwd", "bwd"):
                calls = bench.feature_calls(spec, bench.FEATURES[feature], pas, device)
                times = {m: kernel_times(run, args.runs) for m, (run, _) in calls.items()}
                total = {m: sum(us for _, us in t.values()) for m, t in times.items()}
                print(f"== {feature} on {spec['name']} {pas}: plain {total['plain']:.1f} us, "
                      f"feature {total['feature']:.1f} us ({total['feature'] / total['plain']:.3f}x)")
                for m in ("plain", "feature"):
                    for name, (n, us) in sorted(times[m].items(), key=lambda x: -x[1][1]):
                        print(f"   {m:<8} {n:5.1f} x {us:9.1f} us  {name}")
                del calls
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
