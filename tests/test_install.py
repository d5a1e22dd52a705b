"""The install script's promises, checked on the installed environment."""
import importlib.util
import subprocess
import sys

from launch import BIN


def test_horovod_check_build_lists_pytorch_gloo_and_mpi_and_tensorflow_where_installed():
    """With TensorFlow installed, a Horovod without its TF extension is an install bug (install.sh
    builds Horovod with TF whenever TF is there)."""
    out = subprocess.run([str(BIN / "horovodrun"), "--check-build"], capture_output=True, text=True,
                         timeout=180).stdout
    with_tf = importlib.util.find_spec("tensorflow") is not None
    for line in ("[X] PyTorch", "[X] MPI", "[X] Gloo", *(["[X] TensorFlow"] if with_tf else [])):
        assert line in out, f"{line} missing: rerun REDSYNC_WITH_TF={int(with_tf)} bash scripts/install.sh\n{out}"


def test_mpi4py_and_native_kernel_import():
    # in a process of its own: MPI_Init in pytest's process would put the singleton's OMPI_*/PMIX_*
    # variables into the environment every later subprocess inherits, and a horovodrun started
    # from there exits 1 without a word
    res = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "Open MPI" in res.stdout, res.stdout + res.stderr

    from redsync_hvd.core.select import native_available
    assert native_available(), "the native selection kernel was not built by scripts/install.sh"


def test_every_python_of_the_venv_runs_the_projects_startup():
    """scripts/install.sh's redsync_hvd.pth: a Python that imports nothing of the project has
    TF_CPP_MIN_LOG_LEVEL=2 (TensorFlow's C++ start-up lines hidden), unless the user set it, and
    horovodrun's process is the one that waits for its job (launchers.hook_horovodrun)."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    code = "import os, sys; print(os.environ.get('TF_CPP_MIN_LOG_LEVEL'), 'redsync_hvd._startup' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.stdout.split() == ["2", "True"], (res.stdout, res.stderr, "rerun scripts/install.sh")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "TF_CPP_MIN_LOG_LEVEL": "0"})
    assert res.stdout.split() == ["0", "True"], res.stdout
