"""Under `horovodrun --gloo` mpi4py sees a world of one: building a decentralized method on
mpi4py's transport must raise a clear error on every rank (not hang waiting for neighbours
that are not there). Horovod's own transport, the default, runs under Gloo
(test_decentralized.py::test_every_transport_delivers_the_same_bytes)."""
import horovod.torch as hvd

hvd.init()
from mpi4py import MPI  # noqa: E402

from redsync_hvd.decentralized import build_algorithm  # noqa: E402

try:
    build_algorithm("dcd", comm=MPI.COMM_WORLD)
except RuntimeError as exc:
    print(f"rank {hvd.rank()}: OK clear error: {exc}", flush=True)
else:
    raise SystemExit(f"rank {hvd.rank()}: expected a RuntimeError about the MPI world")
