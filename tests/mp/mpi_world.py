"""mpi4py must see the same MPI world as Horovod (the decentralized methods rely on it)."""
import horovod.torch as hvd
from mpi4py import MPI

hvd.init()
comm = MPI.COMM_WORLD
assert hvd.mpi_enabled(), "Horovod is not running over MPI; launch with horovodrun (MPI controller) or mpirun"
assert comm.Get_size() == hvd.size() and comm.Get_rank() == hvd.rank(), (comm.Get_size(), hvd.size())
total = comm.allreduce(hvd.rank() + 1)
assert total == hvd.size() * (hvd.size() + 1) // 2
print(f"rank {hvd.rank()}: OK mpi4py world size {comm.Get_size()}")
