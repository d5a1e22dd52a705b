"""The install script's promises, checked on the installed environment."""
import subprocess
import sys

from launch import BIN


def test_horovod_check_build_lists_pytorch_gloo_and_mpi():
    out = subprocess.run([str(BIN / "horovodrun"), "--check-build"], capture_output=True, text=True,
                         timeout=120).stdout
    for line in ("[X] PyTorch", "[X] MPI", "[X] Gloo"):
        assert line in out, out


def test_mpi4py_and_native_kernel_import():
    # in a process of its own: MPI_Init in pytest's process would put the singleton's OMPI_*/PMIX_*
    # variables into the environment every later subprocess inherits, and a horovodrun started
    # from there exits 1 without a word
    res = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "Open MPI" in res.stdout, res.stdout + res.stderr

    from redsync_hvd.core.selection import native_available
    assert native_available(), "the native selection kernel was not built by scripts/install.sh"
