#!/bin/bash
# Horovod's own optimizer tests on ours: run.sh <Horovod 0.28.1 checkout> <np> [none|redsync] [check_finite 1|0]
# (without check_finite: the method's default, off for none as in Horovod, on for redsync's residual)
# Without a method: plain Horovod, the baseline. Every test of test/parallel/test_torch.py that
# calls DistributedOptimizer or broadcast_optimizer_state is selected (three need CUDA).
set -euo pipefail
HOROVOD=$1; NP=$2; METHOD=${3:-}; CHECK=${4:-}
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd)
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
cp "$HERE/conftest.py" "$HOROVOD/test/parallel/test_torch.py" "$HOROVOD/test/utils/common.py" "$WORK/"
# common.py imports mock for tests not selected here
python -c "import mock" 2>/dev/null || touch "$WORK/mock.py"
TESTS="test_broadcast_state or test_broadcast_state_options or test_broadcast_state_no_grad or test_force_allreduce \
or test_model_parallelism or test_delta_optimizer or test_duplicate_names or test_dynamic_requires_grad \
or test_gradient_clipping or test_synchronize_step_warning or test_no_named_parameters or test_missing_named_parameters \
or test_optimizer_no_named_parameters or test_sparse_embeddings or test_optimizer_process_sets"
cd "$WORK"
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 \
HOROVOD_DYNAMIC_PROCESS_SETS=1 PYTHONPATH="$REPO:$WORK" REDSYNC_METHOD=$METHOD REDSYNC_CHECK_FINITE=$CHECK \
    horovodrun -np "$NP" -H "localhost:$NP" python -m pytest -q -p no:cacheprovider test_torch.py -k "$TESTS" -rfs
