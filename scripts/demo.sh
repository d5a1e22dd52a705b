#!/usr/bin/env bash
# The README's main job: train the digits CNN on 2 workers, dense and with top-k
# compression, then print accuracy, wire bytes and compression ratio side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${1:-2}
OUT=runs/demo
for cfg in dense topk; do
  echo "== horovodrun -np $NP: configs/digits/$cfg.yaml"
  horovodrun -np "$NP" -H "localhost:$NP" python -m redsync_hvd.train \
    --config "configs/digits/$cfg.yaml" --set output.dir=$OUT --set training.progress=false
done
python scripts/compare_runs.py $OUT/dense $OUT/topk
