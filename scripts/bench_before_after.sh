#!/usr/bin/env bash
# Speed of this tree against another checkout of the project, in one sitting:
# scripts/bench_selection.py and scripts/bench_overhead.py, each tree's own copy on its own
# code, in the order old, new, new, old so that load drifting over the sitting hits both alike.
#
#   git worktree add /tmp/before <commit> && cp redsync_hvd/core/_native/*.so /tmp/before/redsync_hvd/core/_native/
#   bash scripts/bench_before_after.sh /tmp/before [OUT_DIR]
#
# OUT_DIR (default docs/results/cpu-<cores>cores-<date>/before-after) gets selection-{old,new}.md,
# overhead-{old,new}.md and machine.txt (commits, CPU, load average before and after).
# Only the methods both trees have are run. Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=$(cd "${1:?usage: bench_before_after.sh OLD_TREE [OUT_DIR]}" && pwd)
NEW=$PWD
OUT=${2:-docs/results/cpu-$(nproc)cores-$(date +%F)/before-after}
PY=${PYTHON:-python}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SEL=(--sizes 1M,16M --repeats 5)
OVH=(--methods dense,topk,redsync,redsync_noreuse,redsync_mc,redsync_mc_layer,redsync_mc_bucket --rounds 3)

{
  echo "old: $OLD $(git -C "$OLD" rev-parse --short HEAD)"
  echo "new: $NEW $(git rev-parse --short HEAD)"
  grep -m1 "model name" /proc/cpuinfo || true
  echo "cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
} > "$OUT/machine.txt"

# the same rows on both sides: a tree whose bench has the exact-k rows runs without them (their
# 16M CPU reference takes seconds per call and would sit between the timed methods)
sel() {
  local extra=()
  if grep -q -- "--exact-k" "$1/scripts/bench_selection.py"; then extra=(--exact-k ""); fi
  (cd "$1" && PYTHONPATH="$1" $PY scripts/bench_selection.py "${SEL[@]}" "${extra[@]}" --out "$OUT/selection-$2.md")
}
ovh() { (cd "$1" && PYTHONPATH="$1" $PY scripts/bench_overhead.py "${OVH[@]}" --out "$OUT/overhead-$2.md"); }

sel "$OLD" old
sel "$NEW" new
ovh "$NEW" new
ovh "$OLD" old
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/machine.txt"
echo "written: $OUT"
