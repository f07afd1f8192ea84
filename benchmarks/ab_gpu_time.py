"""GPU time of na3d's forward and backward on the benchmark shapes, for A/B runs.

Times whichever ``na3d`` is first on ``sys.path`` (run it once per tree, e.g.
``PYTHONPATH=/tmp/old/src python benchmarks/ab_gpu_time.py --tag old`` and
``PYTHONPATH=src python benchmarks/ab_gpu_time.py --tag new``, alternating) and
prints one JSON line per shape and pass: GPU time by CUDA-graph replay (L2 flushed
before each replay; the backward as forward + backward minus forward, as in the
benchmark), median of ``--repeats`` medians. bf16, inputs as in the benchmark.
``python benchmarks/ab_gpu_time.py --summarize FILE [TAG ...]`` prints those lines'
medians per tag (default: old and new), each over the first tag's.
"""

import argparse
import json
import statistics
import sys
from importlib import resources

import torch


def timer_class():
    """The benchmark's ``Timer`` (where the tree under test keeps it)."""
    for module in ("na3d.tools.common", "na3d.bench"):
        try:
            return __import__(module, fromlist=["Timer"]).Timer
        except (ImportError, AttributeError):
            continue
    raise ImportError("no Timer in this na3d tree")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--shapes", nargs="*", help="shape names (default: the LTX benchmark shapes)")
    parser.add_argument("--spec", action="append", default=[], metavar="NAME:B,T,H,W,NH,HD:KT,KH,KW",
                        help="a shape of one's own (repeatable); with --spec only, just those are timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--dilation", type=int, nargs=3, default=None, help="call with this dilation")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="keys and values: the first this many heads (views, as the benchmark's GQA/MQA rows)")
    parser.add_argument("--assume-finite", action="store_true",
                        help="call with assume_finite=True (trees that have it): no check for inf/NaN")
    args = parser.parse_args(argv)

    import na3d

    # The package keeps the shapes in na3d/tools/ (older trees: na3d/).
    folder = resources.files("na3d") / "tools"
    if not (folder / "bench_shapes.json").is_file():
        folder = resources.files("na3d")
    specs = json.loads((folder / "bench_shapes.json").read_text())["shapes"]
    try:  # the feature rows' base shape (trees that have it)
        specs.append(__import__("na3d.tools.bench", fromlist=["FEATURE_BASE"]).FEATURE_BASE)
    except (ImportError, AttributeError):
        pass
    own = [parse_spec(text) for text in args.spec]
    if args.shapes:
        specs = [s for s in specs if s["name"] in args.shapes] + own
    elif own:
        specs = own
    else:  # the LTX group (older trees list no groups: only those shapes)
        specs = [s for s in specs if s.get("group", "ltx") == "ltx"]
    timer = timer_class()(torch.device("cuda"), graphs=True)
    for spec in specs:
        time_shape(na3d, spec, timer, args)
        torch.cuda.empty_cache()


def parse_spec(text: str) -> dict:
    """``NAME:B,T,H,W,NH,HD:KT,KH,KW`` as a benchmark shape's entry."""
    try:
        name, shape, kernel = text.split(":")
        spec = {"name": name, "shape": [int(x) for x in shape.split(",")],
                "kernel_size": [int(x) for x in kernel.split(",")]}
    except ValueError:
        spec = None
    if spec is None or len(spec["shape"]) != 6 or len(spec["kernel_size"]) != 3:
        raise SystemExit(f"--spec {text!r}: expected NAME:B,T,H,W,NH,HD:KT,KH,KW")
    return spec


def time_shape(na3d, spec, timer, args) -> None:
    """Print the forward's (and backward's) GPU time on one benchmark shape."""
    shape, ks = tuple(spec["shape"]), tuple(spec["kernel_size"])
    scale = shape[-1] ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(shape, generator=gen, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    if args.kv_heads:
        k, v = k[..., :args.kv_heads, :], v[..., :args.kv_heads, :]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    extra = {"assume_finite": True} if args.assume_finite else {}
    if args.dilation:
        extra["dilation"] = tuple(args.dilation)
    if any(x != 1 for x in spec.get("stride", (1, 1, 1))):
        extra["stride"] = tuple(spec["stride"])

    def forward():
        return na3d.na3d(*leaves, ks, scale=scale, **extra)

    def forward_backward():
        return torch.autograd.grad(forward(), leaves, do)

    fwd = [timer(forward, min_runs=20, target_ms=300) for _ in range(args.repeats)]
    name = spec["name"] + ("" if not args.dilation else "-d" + "".join(map(str, args.dilation))) + (
        "" if not args.kv_heads else f"-kv{args.kv_heads}")
    print(json.dumps({"tag": args.tag, "name": name, "pass": "fwd", "gpu_ms": statistics.median(fwd),
                      "runs": [round(t, 5) for t in fwd]}), flush=True)
    if args.no_backward:
        return
    bwd = [timer(forward_backward, min_runs=20, target_ms=300) - timer(forward, min_runs=20, target_ms=300)
           for _ in range(args.repeats)]
    print(json.dumps({"tag": args.tag, "name": name, "pass": "bwd", "gpu_ms": statistics.median(bwd),
                      "runs": [round(t, 5) for t in bwd]}), flush=True)


def summarize(path: str, tags=("old", "new")) -> None:
    """Print, from a file of the lines ``main`` prints, each tag's median per shape and
    pass, then each later tag's over the first's."""
    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    runs = {}
    for r in rows:
        runs.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"])
    print(f"{'shape':<18}{'pass':>5}" + "".join(f" {t:>9}" for t in tags)
          + "".join(f" {t + '/' + tags[0]:>13}" for t in tags[1:]))
    for (name, pas), by_tag in runs.items():
        ms = [statistics.median(by_tag[t]) if t in by_tag else float("nan") for t in tags]
        print(f"{name:<18}{pas:>5}" + "".join(f" {m:>9.4f}" for m in ms)
              + "".join(f" {m / ms[0]:>13.3f}" for m in ms[1:]))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--summarize":  # --summarize FILE [TAG ...], the first the base
        summarize(sys.argv[2], tuple(sys.argv[3:]) or ("old", "new"))
    else:
        main()
