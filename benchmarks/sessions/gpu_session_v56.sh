#!/usr/bin/env bash
# One device call (under 10 minutes), NOTES v40: the LTX dK/dV kernels without their register cap.
# benchmarks/occupancy_scan.py (compiled for sm90 here): the short, small and large windows' dK/dV run capped at
# 168 registers (3 programs of 4 warps per SM, as their 66560 B of shared memory allow), and their key loops spill:
# ltx-stage3 925 instructions per step with 70 local loads and stores (ltx-stage1 919/69, stage 5 834/67).
# Uncapped they compile to 227-240 registers (2 programs per SM) and no local access: ltx-stage3 811 (3 stages),
# 785 (2 stages). The cap dates from loops of about 540 instructions with 10 spill instructions (NOTES v24); the
# tuner has timed these boxes with it only (v35, v51: 2 stages capped lost 3 % to 3 stages capped).
# Trees, alternating, GPU time by graph replay: this one (base); "nocap" (no dkdv_maxnreg in the three buckets and
# their alternatives); "nocap2" (also dkdv_num_stages 2). Then the backward's GPU tests on the LTX shapes, nocap.
# Usage: [END=585] bash benchmarks/sessions/gpu_session_v56.sh   (no carry; END: seconds the whole call may take)
# Prediction: within 5 % either way: 12 % fewer instructions and no local traffic through L1 against a third fewer
# programs to hide latency; forwards unchanged.
set -u
END=${END:-585}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 500 > $OUT/clocks.csv 2>&1 &
for tree in nocap nocap2; do
  rm -rf /tmp/$tree && mkdir -p /tmp/$tree && cp -r src /tmp/$tree/src
  TREE=$tree python3 - <<'PY'
import json, os
tree = os.environ["TREE"]
path = f"/tmp/{tree}/src/na3d/configs/sm90.json"
table = json.load(open(path))
for entry in table["forward"]:
    if entry["bucket"] in ("short_window", "small_window", "large_window"):
        for option in [entry] + entry.get("alternatives", []):
            backward = option.get("backward", {})
            backward.pop("dkdv_maxnreg", None)
            if tree == "nocap2" and "dkdv_num_stages" in backward:
                backward["dkdv_num_stages"] = 2
open(path, "w").write(json.dumps(table, indent=1) + "\n")
PY
done
late() { [ $SECONDS -gt ${LATE:-$((END - 165))} ] && echo "skipped (at ${SECONDS}s): $*" && return 0; return 1; }
SHAPES="ltx-stage1 ltx-stage3 ltx-stage4-tile ltx-stage5-tile ltx-stage5-small feature-base"
ab() { late ab $1 && return; timeout 100 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 3 \
  --shapes $SHAPES >> $OUT/ab.jsonl 2>> $OUT/ab.err; echo "ab $1 rc=$? at ${SECONDS}s"; }
ab base src; ab nocap /tmp/nocap/src; ab nocap2 /tmp/nocap2/src
ab nocap2 /tmp/nocap2/src; ab nocap /tmp/nocap/src; ab base src
python3 - <<'PY'
import json, statistics, os
d = {}
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "ab.jsonl")) if l.startswith("{")):
    d.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"])
print(f"{'shape':<18}{'pass':>5}{'base':>10}{'nocap':>10}{'nocap2':>10}{'nocap/base':>12}{'nocap2/base':>12}")
for (n, p), t in d.items():
    m = {k: statistics.median(v) for k, v in t.items()}
    nan = float("nan")
    print(f"{n:<18}{p:>5}" + "".join(f"{m.get(k, nan):>10.4f}" for k in ("base", "nocap", "nocap2"))
          + f"{m.get('nocap', nan) / m.get('base', nan):>12.3f}{m.get('nocap2', nan) / m.get('base', nan):>12.3f}")
PY
echo "=== the backward's GPU tests on the LTX shapes, nocap"
timeout $((END - SECONDS)) env PYTHONPATH=/tmp/nocap/src python3 -m pytest -q -n 4 -k "ltx-stage1 or ltx-stage3 or edge" \
  tests/kernels/test_backward.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests.log
echo "done at ${SECONDS}s"
