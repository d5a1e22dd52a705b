"""Under `horovodrun --gloo` mpi4py sees a world of one: building a decentralized method
must raise a clear error on every rank (not hang waiting for neighbours that are not there)."""
import horovod.torch as hvd

hvd.init()
from redsync_hvd.decentralized import build_algorithm  # noqa: E402

try:
    build_algorithm("dcd")
except RuntimeError as exc:
    print(f"rank {hvd.rank()}: OK clear error: {exc}", flush=True)
else:
    raise SystemExit(f"rank {hvd.rank()}: expected a RuntimeError about the MPI world")
