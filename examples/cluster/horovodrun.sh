#!/bin/bash
# A multi-host Horovod job, as Horovod starts one: run on one of the hosts, horovodrun reaches the
# others over ssh (passwordless, the same paths on every host; docs/cluster.md).
#
#   HOSTS=hostA:2,hostB:2 bash examples/cluster/horovodrun.sh configs/digits/redsync.yaml [--set k=v ...]
#   HOSTFILE=hosts.txt    bash examples/cluster/horovodrun.sh ...     # lines "hostA slots=2"
#
# NP (default: every slot) sets the number of workers. Run by examples/cluster/slurm_horovod.sbatch,
# and by tests/test_cluster.py on two emulated hosts.
set -euo pipefail
CONFIG=${1:?usage: HOSTS=hostA:N,hostB:N bash horovodrun.sh <config.yaml> [--set k=v ...]}
shift
if [ -n "${HOSTFILE:-}" ]; then
  slots=$(grep -o 'slots=[0-9]*' "$HOSTFILE" | cut -d= -f2 | paste -sd+ -)
  hosts=(-hostfile "$HOSTFILE")
else
  slots=$(echo "${HOSTS:?set HOSTS=hostA:N,hostB:N or HOSTFILE=<file>}" | tr ',' '\n' | cut -d: -f2 | paste -sd+ -)
  hosts=(-H "$HOSTS")
fi
exec horovodrun -np "${NP:-$((slots))}" "${hosts[@]}" python -m redsync_hvd.train --config "$CONFIG" "$@"
