#!/usr/bin/env bash
# The GPU checks, as one short script for a CUDA machine (an H100 or H200: under 7 minutes).
#
#   bash scripts/gpu_check.sh              # python3 with torch (CUDA), triton; cupy, pytest, hypothesis if there
#   PY=python RESULTS=/tmp/r bash scripts/gpu_check.sh
#   OUT=/some/dir bash scripts/gpu_check.sh    # also ONE gpu_check.tgz of the results + summary.json in $OUT
#   bash scripts/gpu_check.sh --cpu        # smoke run of every step on the CPU (tiny sizes, kernels in
#                                          # Triton's interpreter), results in /tmp: checks the script itself
#
# Writes docs/results/<gpu>-<date>/ (or $RESULTS): the logs of every step, the tables, and
# summary.json (scripts/gpu_summary.py). Each step has its own time limit and a failed or
# timed-out step only leaves its keys null: the summary is rewritten after every step, and the
# benchmarks write what they have after each size, model or row. Where the caller sets $OUT (a
# folder whose files are returned, as on a lent device), gpu_check.tgz (the results folder) and
# summary.json are refreshed at the top of $OUT after every step: a flat, short return path.
#
# A machine without pydantic (a lent GPU machine has no package index): run
# `bash scripts/fetch_wheels.sh` where pip works and bring .whl/ along; the wheels are then
# installed into /tmp/site before anything else. The first step lists every Python package the
# others need that does not import.
#
# Steps (limits in seconds, 390 in all; the previous version's eight steps took 140 s on an H100):
#   deps       the Python packages the steps need: which do not import              10
#   env        nvidia-smi and versions                                              10
#   compile    scripts/compile_kernels.py --quick: does this Triton compile them,
#              with how many registers, any spills, 128-bit loads                   30
#   tests      the exact-k tests on CUDA (compiled kernels against the reference,
#              five launches, the exchange's radix stage, its device syncs)         90
#   tests_old  the existing CUDA tests (selection, CuPy kernels, bucket path)      20
#   selection  bench_selection.py: exact-k (torch ops, Triton, CUDA graph) first, then
#              the CuPy tbs/trimmed rows (where CuPy builds its kernels) against
#              torch.topk, 1M/16M/64M, D=0.001/0.01                                 45
#   passes     bench_passes.py: what a pass and each exact-k stage costs at 16M
#              (triton.testing.do_bench)                                          30
#   stages     bench_bucket_select.py: the exact-k stages against model compute      25
#   overhead   bench_overhead.py: the exchange against compute at batch 16 and 128,
#              its host reads per step (the exact-k methods first, dense, the
#              per-layer and tbs bucket paths; eager and, where configured, graph)  55
#   profile    profile_exchange.py: device time and kernel launches per exchange
#              step (torch.profiler), batch 16 and 128; the 16M select against topk  35
#   roofline   bench_roofline.py: compensation + selection per mode against a
#              triad's bandwidth, 16M and 64M fp32 (Triton's exact-k)                30
#   summary    scripts/gpu_summary.py (also after every step)                       10
# (--cpu scales every limit by 3: a shared CPU runs the same steps)
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
CPU=0 SCALE=1
[ "${1:-}" = "--cpu" ] && CPU=1 SCALE=3

# the wheels of packages this machine lacks (scripts/fetch_wheels.sh), before anything imports them
if [ "$CPU" = 0 ] && ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import pydantic" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH && echo "installed .whl/ into /tmp/site"
fi

if [ "$CPU" = 1 ]; then
  export TRITON_INTERPRET=1
  DEV=cpu
  RESULTS=${RESULTS:-/tmp/gpu_check_cpu-$(date +%Y-%m-%d)}
else
  unset TRITON_INTERPRET
  DEV=cuda
  NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  SLUG=$(echo "${NAME:-gpu}" | grep -oE '[A-Z][0-9]{2,4}' | head -1 | tr 'A-Z' 'a-z')
  RESULTS=${RESULTS:-docs/results/${SLUG:-gpu}-$(date +%Y-%m-%d)}
  if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "no CUDA device here: every CUDA step will fail and leave its keys null (bash $0 --cpu checks the script)"
  fi
fi
mkdir -p "$RESULTS"
: > "$RESULTS/steps.txt"
FAILED=""
echo "results: $RESULTS"

publish() {  # the summary so far, and where the caller wants it, one .tgz of the results + summary.json
  "$PY" scripts/gpu_summary.py "$RESULTS" >/dev/null 2>>"$RESULTS/summary.log"
  if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    tar czf "$OUT/gpu_check.tgz.part" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" \
      && mv "$OUT/gpu_check.tgz.part" "$OUT/gpu_check.tgz"
    [ -f "$RESULTS/summary.json" ] && cp "$RESULTS/summary.json" "$OUT/summary.json"
  fi
}

step() {  # step NAME LIMIT_S COMMAND...: run with a limit, log to NAME.log, record status and time
  local name=$1 limit=$(( $2 * SCALE )) t0 rc
  shift 2
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  rc=$?
  [ "$rc" = 0 ] || FAILED="$FAILED $name"
  printf '%-10s rc=%-3s %4ss (limit %ss)%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" \
    "$([ "$rc" = 124 ] && echo ' TIMED OUT')" | tee -a "$RESULTS/steps.txt"
  tail -n 4 "$RESULTS/$name.log" | sed 's/^/    /'
  publish
}

step deps 10 "$PY" - <<'PY'
import importlib, sys
need = ["torch", "triton", "numpy", "pydantic", "yaml", "pytest", "hypothesis", "redsync_hvd.engine"]
optional = ["cupy"]
missing = []
for name in need + optional:
    try:
        importlib.import_module(name)
    except Exception as e:   # ImportError, or a package that breaks on import
        missing.append(name)
        print("missing%s: %s (%s: %s)" % (" (optional)" if name in optional else "", name, type(e).__name__, e))
print("all needed packages import" if not set(missing) - set(optional) else
      "missing: %s (a lent machine: bash scripts/fetch_wheels.sh here, bring .whl/)" % ", ".join(missing))
sys.exit(1 if set(missing) - set(optional) else 0)
PY

step env 10 "$PY" - "$RESULTS/env.json" "$DEV" <<'PY'
import json, subprocess, sys
import torch
cuda = sys.argv[2] == "cuda"
env = {"device": torch.cuda.get_device_name() if cuda else "cpu (smoke run)", "torch": torch.__version__,
       "cuda": torch.version.cuda}
for mod in ("triton", "cupy", "pytest", "hypothesis", "pydantic"):
    try:
        env[mod] = __import__(mod).__version__
    except ImportError:
        env[mod] = None
try:
    env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True).stdout.strip()
except OSError:
    env["driver"] = None
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(env)
PY

EXACT="redsync_mc_exact_k,redsync_mc_exact_k_graph,redsync_mc_exact_k_torch"   # the exact-k rows first
if [ "$CPU" = 1 ]; then   # the same steps on tiny inputs: each command, its flags and the summary's parsing
  step compile 30 env -u TRITON_INTERPRET "$PY" scripts/compile_kernels.py --quick --arch 90
  step tests 90 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_triton_select.py -k "exchange or five"
  step tests_old 20 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_bucket_select.py -k cuda
  SEL=(--device cpu --sizes 64K --densities 0.001 --methods "" --exact-k torch,triton --repeats 2)
  PASSES=(--device cpu)
  STAGES=(--device cpu --models resnet20 --backends torch --steps 1 --warmup 0)
  OVER=(--device cpu --models resnet20 --rounds 1 --steps 1 --warmup 1 --batches 16,32
        --methods redsync_mc_exact_k,redsync_mc_exact_k_graph,dense)
  PROFILE=(--device cpu --models resnet20 --batches 16 --size 16K --warmup 1 --repeats 1)
  ROOF=(--device cpu --sizes 1M --steps 2 --warmup 1 --exact-steps 1)
else
  ARCH=$("$PY" -c 'import torch; a, b = torch.cuda.get_device_capability(); print(a * 10 + b)' 2>/dev/null)
  step compile 30 "$PY" scripts/compile_kernels.py --quick --arch "${ARCH:-90}"
  step tests 90 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_triton_select.py tests/test_radix_select.py \
    -k "not compiles_for_sm90"   # the compile step above does that
  step tests_old 20 "$PY" -m pytest -q -ra -p no:cacheprovider tests/test_selection.py tests/test_compressors.py \
    tests/test_bucket_select.py -k cuda
  # the CuPy kernels (the selection registry's "cuda" backend) only where CuPy imports AND builds and runs them
  if "$PY" -c "
import sys, torch
from redsync_hvd.core.select import Contract, cupy_kernels, select, single
sys.exit(0 if cupy_kernels.load() is not None and select(single(4096, 4), torch.randn(4096, device='cuda'),
                                                          Contract('tbs', backend='cuda')).positions.numel() >= 4 else 1)" 2>/dev/null; then
    CUPY=(--methods tbs,trimmed --backend cuda)
  else
    echo "CuPy's kernels do not load here: no tbs/trimmed rows" | tee -a "$RESULTS/steps.txt"
    CUPY=(--methods "")
  fi
  SEL=(--device cuda --sizes 1M,16M,64M --densities 0.001,0.01 "${CUPY[@]}" --exact-k triton,triton-graph,torch
       --repeats 11)
  PASSES=(--device cuda)
  STAGES=(--device cuda)
  OVER=(--device cuda --threads 0 --rounds 2 --steps 6 --batches 16,128
        --methods "$EXACT,dense,redsync_mc_layer,redsync_mc_bucket")
  PROFILE=(--device cuda --batches 16,128 --size 16M)
  ROOF=(--device cuda --sizes 16M,64M --backend triton)
fi

step selection 45 "$PY" scripts/bench_selection.py --dists gauss "${SEL[@]}" --out "$RESULTS/selection.json"
sed -n '/^Machine:/,$p' "$RESULTS/selection.log" > "$RESULTS/selection.md"

step passes 30 "$PY" scripts/bench_passes.py "${PASSES[@]}" --out "$RESULTS/passes.json"
sed -n '/^Device:/,$p' "$RESULTS/passes.log" > "$RESULTS/passes.md"

step stages 25 "$PY" scripts/bench_bucket_select.py "${STAGES[@]}" --out "$RESULTS/stages.json"
sed -n '/^Device:/,$p' "$RESULTS/stages.log" > "$RESULTS/stages.md"

step overhead 55 "$PY" scripts/bench_overhead.py "${OVER[@]}" --out "$RESULTS/overhead_cuda.md" \
  --json "$RESULTS/overhead.json"

step profile 35 "$PY" scripts/profile_exchange.py "${PROFILE[@]}" --out "$RESULTS/profile.json"
cp "$RESULTS/profile.log" "$RESULTS/profile.txt" 2>/dev/null

step roofline 30 "$PY" scripts/bench_roofline.py "${ROOF[@]}" --out "$RESULTS/roofline.json"
sed -n '/^Device:/,$p' "$RESULTS/roofline.log" > "$RESULTS/roofline.md"

step summary 10 "$PY" scripts/gpu_summary.py "$RESULTS"
cat "$RESULTS/steps.txt"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then echo "in $OUT: gpu_check.tgz (the folder $RESULTS) and summary.json"; fi
[ -z "$FAILED" ] || { echo "failed steps:$FAILED"; exit 1; }
