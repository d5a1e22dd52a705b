#!/bin/bash
# A multi-host Horovod job started by Open MPI's mpirun itself, with the options Horovod documents
# (docs/cluster.md): no core binding, ranks filled host by host, TCP between hosts, and the
# environment every rank needs passed with -x.
#
#   HOSTFILE=hosts.txt bash examples/cluster/mpirun.sh configs/digits/redsync.yaml [--set k=v ...]
#
# HOSTFILE lines: "hostA slots=2". NP (default: every slot) sets the number of workers.
# IFACE (optional) is the network interface between the hosts (btl_tcp_if_include).
set -euo pipefail
CONFIG=${1:?usage: HOSTFILE=<file> bash mpirun.sh <config.yaml> [--set k=v ...]}
shift
slots=$(grep -o 'slots=[0-9]*' "${HOSTFILE:?set HOSTFILE=<file> (lines: hostA slots=N)}" | cut -d= -f2 | paste -sd+ -)
options=()
if [ -n "${IFACE:-}" ]; then
  options+=(-mca btl_tcp_if_include "$IFACE")
fi
# the variables that are set (-x of an unset one is an error)
for var in PATH PYTHONPATH LD_LIBRARY_PATH OMP_NUM_THREADS OMPI_MCA_mpi_yield_when_idle; do
  if [ -n "${!var:-}" ]; then
    options+=(-x "$var")
  fi
done
exec mpirun -np "${NP:-$((slots))}" --hostfile "$HOSTFILE" -bind-to none -map-by slot \
  -mca pml ob1 -mca btl ^openib "${options[@]}" python -m redsync_hvd.train --config "$CONFIG" "$@"
