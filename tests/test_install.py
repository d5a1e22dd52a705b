"""The install script's promises, checked on the installed environment."""
import subprocess

from launch import BIN


def test_horovod_check_build_lists_pytorch_gloo_and_mpi():
    out = subprocess.run([str(BIN / "horovodrun"), "--check-build"], capture_output=True, text=True,
                         timeout=120).stdout
    for line in ("[X] PyTorch", "[X] MPI", "[X] Gloo"):
        assert line in out, out


def test_mpi4py_and_native_kernel_import():
    import mpi4py.MPI  # noqa: F401

    from redsync_hvd.core.selection import native_available
    assert native_available(), "the native selection kernel was not built by scripts/install.sh"
