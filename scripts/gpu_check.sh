#!/usr/bin/env bash
# The GPU checks, as one short script for a CUDA machine (see docs/benchmarks.md):
# the CUDA tests (selection, CuPy kernels, compressors on CUDA tensors), then the
# selection benchmark with the CuPy kernels and with plain torch ops, each against
# torch.topk in the same process. Results go to $OUT (default ./gpu-results).
#   bash scripts/gpu_check.sh            # python3 with torch (CUDA), cupy, pydantic, pytest
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/gpu.txt"
$PY -m pytest -q -ra -p no:cacheprovider tests/test_selection.py tests/test_compressors.py \
    tests/test_bucket_select.py -k cuda \
    2>&1 | tee "$OUT/tests.txt"
for backend in cuda torch; do
  $PY scripts/bench_selection.py --device cuda --backend "$backend" --repeats 11 \
      --out "$OUT/selection_$backend.md" 2>&1 | tail -n 40
done
# compression overhead against compute on the GPU (no Horovod, no network); among the
# methods, redsync_mc_layer against redsync_mc_bucket: per-layer searches against one
# selection per bucket (selection_scope)
$PY scripts/bench_overhead.py --device cuda --threads 0 --out "$OUT/overhead_cuda.md" 2>&1 | tail -n 12
