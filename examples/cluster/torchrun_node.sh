#!/bin/bash
# One host's part of a multi-host torch.distributed job (engine: ddp or fsdp): run it on every host
# (srun does, in examples/cluster/slurm_torchrun.sbatch); the hosts meet at HEAD's c10d rendezvous.
#
#   HEAD=hostA NNODES=2 bash examples/cluster/torchrun_node.sh configs/digits/redsync.yaml [--set k=v ...]
#
# NPROC: workers on this host (its GPUs; default 1). ENGINE: ddp (default) or fsdp. PORT: the
# rendezvous port on HEAD (default 29400). JOB_ID: the same on every host, new for every job.
set -euo pipefail
CONFIG=${1:?usage: HEAD=<first host> NNODES=<hosts> bash torchrun_node.sh <config.yaml> [--set k=v ...]}
shift
exec torchrun --nnodes "${NNODES:?set NNODES=<number of hosts>}" --nproc_per_node "${NPROC:-1}" \
  --rdzv_backend c10d --rdzv_endpoint "${HEAD:?set HEAD=<first host>}:${PORT:-29400}" --rdzv_id "${JOB_ID:-redsync}" \
  -m redsync_hvd.train --config "$CONFIG" --set engine="${ENGINE:-ddp}" "$@"
