#!/usr/bin/env bash
# One short device call, NOTES v45: head dim 128 with 3x5x5 and 3x7x7 windows in the medium window's bucket.
# Compiled for sm90 here (benchmarks/launched_sass.py), the short and small windows' kernels spill at head dim 128:
# 3x5x5's forward is one warp at 255 registers (15 local accesses per step), its dQ (capped at 128) 62, its dK/dV
# (uncapped) 50; 3x7x7's dQ 62 and dK/dV 57. The medium window's at 3x5x5: forward 4 warps, 245 registers, no local
# access; dQ 168 registers, none (loop 393 instructions against 656); dK/dV 21 (842 against 974).
# Trees, GPU time by graph replay, two rounds alternating: new (this tree), hd64only (short_window and small_window
# only for head dims up to 64: head dim 128 falls to medium_window). Then the head-dim-128 GPU test of hd64only.
# Usage: bash benchmarks/sessions/gpu_session_v65.sh   (no carry)
# Prediction: hd64only / new about 0.8 on the forwards and 0.7-0.8 on the backwards; no change at head dim 64 (the
# LTX rows do not take these entries' new condition).
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/env.txt
python3 benchmarks/table_tree.py /tmp/hd64only --set 'short_window.when={"kernel_volume_max": 100, "head_dim_max": 64}' \
  --set 'small_window.when={"kernel_volume_max": 200, "head_dim_max": 64}'
SPECS="--spec hd128-3x5x5:1,24,48,64,8,128:3,5,5 --spec hd128-3x7x7:1,18,32,48,16,128:3,7,7"
ab() { timeout 80 env PYTHONPATH=$2 python3 benchmarks/ab_gpu_time.py --tag $1 --repeats 3 $SPECS >> $OUT/ab.jsonl 2>> $OUT/ab.err
  echo "ab $1 rc=$? at ${SECONDS}s"; }
ab new src; ab hd64only /tmp/hd64only/src; ab hd64only /tmp/hd64only/src; ab new src
python3 - <<'PY'
import json, statistics, os
d = {}
for r in (json.loads(l) for l in open(os.path.join(os.environ["OUT"], "ab.jsonl")) if l.startswith("{")):
    d.setdefault((r["name"], r["pass"]), {}).setdefault(r["tag"], []).append(r["gpu_ms"])
for (n, p), t in d.items():
    m = {k: statistics.median(v) for k, v in t.items()}
    print(f"{n:<14}{p:>5}  new {m.get('new', 0):.4f}  hd64only {m.get('hd64only', 0):.4f}  "
          f"ratio {m.get('hd64only', 0) / m.get('new', 1):.3f}  runs {t}")
PY
echo "=== the head-dim-128 GPU test of hd64only"
timeout $((300 - SECONDS)) env PYTHONPATH=/tmp/hd64only/src python3 -m pytest -q -m "" -n 4 -p no:cacheprovider \
  -k "dit_regime" tests/kernels/test_backward.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$? at ${SECONDS}s"; tail -3 $OUT/gpu_tests.log
