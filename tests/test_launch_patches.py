"""horovodrun's build check, answered from a cache (redsync_hvd/launch_patches.py)."""
import json
import os
import subprocess
import sys

from launch import REPO, horovodrun

from redsync_hvd import launch_patches

# which launcher started this rank, as the rank sees it (redsync_hvd.launchers.kind)
KIND = "from redsync_hvd.launchers import kind; import horovod.torch as hvd; hvd.init(); print(f'kind {kind()}')"


def test_an_answer_is_asked_once_then_read_and_verbose_always_asks(tmp_path):
    asked = []

    def mpi_built(*args, verbose=False):
        asked.append((args, verbose))
        return True
    path = tmp_path / "cache" / "answers.json"
    check = launch_patches.cached("mpi_built", mpi_built, path)
    assert check() is True and check() is True
    assert asked == [((), False)]
    assert json.loads(path.read_text()) == {"mpi_built": True}
    assert check(verbose=True) is True and asked[-1] == ((), True)     # printed as horovodrun prints it
    available = launch_patches.cached("extension_available", lambda name, verbose=False: name == "torch", path)
    assert available("torch") is True and available("mxnet") is False
    assert json.loads(path.read_text()) == {"mpi_built": True, "extension_available:torch": True,
                                            "extension_available:mxnet": False}


def test_an_unwritable_cache_asks_every_time(tmp_path):
    asked = []
    (tmp_path / "file").write_text("")
    check = launch_patches.cached("gloo_built", lambda verbose=False: asked.append(1) or True,
                                  tmp_path / "file" / "answers.json")    # under a file: cannot be made
    assert check() and check() and len(asked) == 2


def test_an_unknown_mpi_is_asked_every_time_and_a_known_one_once(tmp_path):
    answers = iter(["Unknown", "OpenMPI", "MPICH"])
    asked = []

    def detect(env=None):
        asked.append(env)
        return next(answers)
    path = tmp_path / "answers.json"
    check = launch_patches.cached_mpi(detect, path, ("OpenMPI", "MPICH"))
    env = {"PATH": os.environ["PATH"]}
    assert [check(env), check(env), check(env)] == ["Unknown", "OpenMPI", "OpenMPI"] and len(asked) == 2
    assert check({"PATH": str(tmp_path)}) == "MPICH"       # no mpirun on that PATH: horovodrun's own answer


def _fingerprint(root) -> str:
    code = "from redsync_hvd.launch_patches import fingerprint; print(fingerprint())"
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO}"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def test_a_reinstalled_extension_changes_the_fingerprint(tmp_path):
    """Another Horovod extension library (size or time) is another cache file: asked afresh."""
    package = tmp_path / "horovod"
    (package / "torch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    lib = package / "torch" / "mpi_lib_v2.so"
    lib.write_bytes(b"one build")
    first = _fingerprint(tmp_path)
    assert _fingerprint(tmp_path) == first
    lib.write_bytes(b"another build")
    assert _fingerprint(tmp_path) != first
    os.utime(lib, ns=(1, 1))
    assert _fingerprint(tmp_path) not in (first, _fingerprint(REPO / "no-such-folder"))


def test_horovodrun_launches_as_its_cached_answers_say(tmp_path):
    """A real horovodrun writes its answers (built with MPI, Open MPI's mpirun); the next launch
    reads them: told the build has no MPI but has Gloo, it starts the ranks under Gloo; with
    REDSYNC_BUILD_CHECK_CACHE=off it asks afresh, and starts them under mpirun again."""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    out = horovodrun(["python", "-c", KIND], env=env, timeout=120).stdout
    assert out.count("kind mpirun") == 2, out[-2000:]
    [path] = (tmp_path / "redsync_hvd").glob("horovod-build-*.json")
    answers = json.loads(path.read_text())
    assert answers["mpi_built"] is True
    assert [v for k, v in answers.items() if k.startswith("mpi_implementation:")] == ["OpenMPI"]
    path.write_text(json.dumps({**answers, "mpi_built": False, "gloo_built": True}))
    out = horovodrun(["python", "-c", KIND], env=env, timeout=120).stdout
    assert out.count("kind gloo") == 2, out[-2000:]
    out = horovodrun(["python", "-c", KIND], env={**env, "REDSYNC_BUILD_CHECK_CACHE": "off"}, timeout=120).stdout
    assert out.count("kind mpirun") == 2, out[-2000:]
