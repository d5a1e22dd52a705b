#!/usr/bin/env bash
# The README's main job: train the digits CNN on 2 workers (20 epochs, seed 0) dense, with
# PowerSGD (the incumbent), with RedSync and with SBC, then print ONE table: accuracy,
# compression ratio, bytes and wall time. Everything a run prints (Horovod's start-up lines,
# errors) goes to runs/demo/<run>.log; its per-layer decisions to runs/demo/<run>/layers.log.
# A second `make demo` replaces the first one's runs (output.overwrite=true): no run folder holds
# files of two runs.
# One seed: the accuracies of the compressed runs move by about a point from seed to seed;
# configs/sweeps/baselines.yaml gives the mean over seeds (docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${1:-2}
OUT=runs/demo
mkdir -p "$OUT"
# horovodrun's launcher imports horovod.tensorflow to see what Horovod was built with, and with
# it TensorFlow's C++ start-up lines; the workers of a torch run never import TensorFlow
export TF_CPP_MIN_LOG_LEVEL=2
for cfg in dense powersgd redsync sbc; do
  printf '%-13s horovodrun -np %s ... --config configs/digits/%s.yaml' "$cfg" "$NP" "$cfg"
  start=$(date +%s)
  if ! horovodrun -np "$NP" -H "localhost:$NP" python -m redsync_hvd.train \
      --config "configs/digits/$cfg.yaml" --set output.dir=$OUT --set training.progress=false --set output.overwrite=true \
      > "$OUT/$cfg.log" 2>&1; then
    echo " failed; see $OUT/$cfg.log:"; tail -20 "$OUT/$cfg.log"; exit 1
  fi
  echo " ($(( $(date +%s) - start )) s)"
done
echo
python scripts/compare_runs.py --markdown $OUT/dense $OUT/powersgd $OUT/redsync $OUT/sbc
