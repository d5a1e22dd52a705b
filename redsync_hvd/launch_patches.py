"""What changes in ``horovod.runner.launch`` as horovodrun's process loads it.

1. :func:`after_launch`: a patch runs on the module as soon as it has run, before horovodrun
   calls into it (redsync_hvd/_startup.py installs them; :mod:`redsync_hvd.hosts` wraps the ssh
   check this way).
2. :func:`hook_build_check`: horovodrun's build check, answered from a cache. Before every launch
   horovodrun asks how Horovod was built (MPI? Gloo?), and each answer forks a process that imports
   a framework's Horovod extension, which imports the framework (``horovod.torch`` imports torch).
   The answers depend only on the installed files, so they are kept under the size and modification
   time of Horovod's extension libraries, the frameworks' packages and the Python that loads them
   (:func:`fingerprint`): reinstalling any of them asks afresh. ``horovodrun --verbose`` always asks
   (it prints each answer as it finds it). Where the cache cannot be written, or with
   ``REDSYNC_BUILD_CHECK_CACHE=off`` in the environment, horovodrun asks as before.
3. The same for its check of which MPI ``mpirun`` is: ``mpirun --version``, run through a
   spawned helper process that imports horovodrun's launcher again. That answer is kept under
   the size and modification time of the ``mpirun`` the launch's PATH finds; an unknown or
   missing MPI is asked every time (horovodrun then says what it found). Both cached, an empty
   ``horovodrun -np 2`` on the 2-core Xeon test VM takes 2.98 s instead of 4.09 s
   (:mod:`redsync_hvd.experiments.launch_bench`).

Imports nothing outside the standard library at load: horovodrun's process imports it at start-up.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

LAUNCH = "horovod.runner.launch"
MPI_RUN = "horovod.runner.mpi_run"
# the build checks horovod.runner.launch imports from horovod.common.util; each forks an import
BUILD_CHECKS = ("extension_available", "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built")
FRAMEWORKS = ("torch", "tensorflow", "mxnet")
OFF_SWITCH = "REDSYNC_BUILD_CHECK_CACHE"


class _AfterLaunch(importlib.abc.MetaPathFinder):
    """Runs ``patches`` on ``horovod.runner.launch`` as soon as that module has run."""

    def __init__(self):
        self.patches = []

    def find_spec(self, fullname, path, target=None):
        if fullname != LAUNCH:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            for patch in self.patches:
                patch(module)
        spec.loader.exec_module = exec_module
        return spec


def after_launch(patch) -> None:
    """Run ``patch(module)`` once horovodrun's launcher module has loaded (each patch once)."""
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterLaunch)), None)
    if finder is None:
        finder = _AfterLaunch()
        sys.meta_path.insert(0, finder)
    if patch not in finder.patches:
        finder.patches.append(patch)


# -- the build check's cache ------------------------------------------------------------------------
def fingerprint() -> str:
    """What the build checks' answers depend on: this Python, Horovod's compiled extensions and
    each installed framework's package (size and modification time of each file)."""
    horovod = importlib.util.find_spec("horovod")
    files = sorted(glob.glob(os.path.join(os.path.dirname(horovod.origin), "*", "*.so"))) if horovod else []
    for name in FRAMEWORKS:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            files.append(spec.origin)
    parts = [sys.executable]
    for path in files:
        stat = os.stat(path)
        parts.append(f"{path}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def cache_path(key: str) -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "redsync_hvd" / f"horovod-build-{key}.json"


def _load(path: Path) -> dict:
    try:
        answers = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return answers if isinstance(answers, dict) else {}


def _store(path: Path, answers: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(answers, sort_keys=True))
        os.replace(tmp, path)     # a launch beside this one reads the old file or the new, never half
    except OSError:
        pass                      # a read-only home: every launch asks, as horovodrun does


def cached(name: str, check, path: Path):
    """``check`` (one of horovod.common.util's build checks) that answers from ``path`` once it
    has asked; with ``verbose`` it always asks."""
    def answer(*args, verbose=False):
        if verbose:
            return check(*args, verbose=verbose)
        key = ":".join([name, *map(str, args)])
        answers = _load(path)
        if key not in answers:
            answers[key] = check(*args)
            _store(path, answers)
        return answers[key]
    return answer


def cached_mpi(detect, path: Path, known: tuple):
    """``detect`` (horovod.runner.mpi_run._get_mpi_implementation) that answers from ``path`` for
    an ``mpirun`` it has seen (one of the ``known`` implementations)."""
    def answer(env=None):
        found = shutil.which("mpirun", path=(os.environ if env is None else env).get("PATH"))
        if found is None:
            return detect(env)
        stat = os.stat(os.path.realpath(found))
        key = f"mpi_implementation:{os.path.realpath(found)}:{stat.st_size}:{stat.st_mtime_ns}"
        answers = _load(path)
        if answers.get(key) in known:
            return answers[key]
        impl = detect(env)
        if impl in known:
            answers[key] = impl
            _store(path, answers)
        return impl
    return answer


def cache_build_checks(module) -> None:
    """Wrap ``module``'s build checks (horovod.runner.launch's) with :func:`cached`, and the MPI
    check of horovod.runner.mpi_run, which it has imported, with :func:`cached_mpi`."""
    path = cache_path(fingerprint())
    for name in BUILD_CHECKS:
        check = getattr(module, name, None)
        if check is not None:
            setattr(module, name, cached(name, check, path))
    mpi_run = sys.modules.get(MPI_RUN)
    detect = getattr(mpi_run, "_get_mpi_implementation", None)
    if detect is not None:
        known = tuple(getattr(mpi_run, name) for name in ("_OMPI_IMPL", "_SMPI_IMPL", "_MPICH_IMPL", "_IMPI_IMPL")
                      if hasattr(mpi_run, name))
        mpi_run._get_mpi_implementation = cached_mpi(detect, path, known)


def hook_build_check() -> None:
    """In horovodrun's process, before it imports its launcher (not with
    ``REDSYNC_BUILD_CHECK_CACHE=off``)."""
    if os.environ.get(OFF_SWITCH, "").lower() not in ("off", "0", "false", "no"):
        after_launch(cache_build_checks)
