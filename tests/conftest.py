"""Shared test setup: Triton's interpreter without its repeated patching (CPU test time only).

Triton's interpreter (``TRITON_INTERPRET=1``, the CPU runs of tests/test_triton_select.py)
replaces triton.language's builtins by numpy versions before each kernel. Each call of one of
its own library functions inside a kernel (``tl.sum``, ``tl.cumsum``, ``tl.max``...) replaces
them again for that library module, scanning it with ``inspect.getmembers`` (about 10 ms a
call), and never undoes it. Replacing a module that is already replaced changes nothing, so
here each such library module is replaced once per process: the kernels compute the same,
several times faster. Kernels' own modules are untouched (their replacement is undone after
every launch, as before). Without the interpreter, or with a Triton lacking these internals,
nothing is changed.
"""
import ctypes
import os

import pytest

_DONE = []
_LIBC = ctypes.CDLL(None)
_LIBC.getenv.restype = ctypes.c_char_p


def _patch_library_modules_once() -> None:
    if _DONE or os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    _DONE.append(True)
    try:
        import triton.runtime.interpreter as interpreter
        patch, scope = interpreter._patch_lang, interpreter._LangPatchScope
    except (ImportError, AttributeError):
        return
    done = set()

    def once(fn):
        module = getattr(fn, "__module__", "") or ""
        if module.startswith("triton.language."):
            if module in done:
                return scope()
            done.add(module)
        return patch(fn)
    interpreter._patch_lang = once


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes long (make test-fast leaves these out)")


def pytest_runtest_setup(item):
    """Once the test modules are imported: tests/test_triton_select.py sets TRITON_INTERPRET
    at its import on a machine without CUDA."""
    _patch_library_modules_once()


@pytest.fixture(autouse=True)
def _no_mpi_in_pytests_own_process(request):
    """MPI_Init here (mpi4py's import, hvd.init()) sets the singleton's PMIX_*/OMPI_* variables
    in the C environment that later subprocesses inherit (os.environ does not show them); a
    horovodrun started from there exits 1 without output. A test doing so fails by name."""
    yield
    if _LIBC.getenv(b"PMIX_NAMESPACE"):
        pytest.fail(f"{request.node.nodeid} initialized MPI in pytest's own process; do it in a subprocess")
