"""How a rank hears that its job is interrupted (redsync_hvd/launchers.py, redsync_hvd/preemption.py),
with real processes but no launcher: what mpirun does to its ranks' process groups is done by
hand here, in a second; the launchers themselves are in tests/test_interrupted.py and
tests/test_reliability.py.
"""
import os
import signal
import subprocess
import sys
import time

import pytest
from launch import REPO

from redsync_hvd import launchers
from redsync_hvd.preemption import QuietStream, StopController

# a "rank" as mpirun starts one: a process group of its own in the launcher's session
RANK = """
import os, signal, sys, time
from redsync_hvd import launchers
relay = launchers.start_relay()
print("relay", relay.pid if relay else None, flush=True)
got = []
signal.signal(signal.SIGINT, lambda s, f: got.append("SIGINT"))
signal.signal(signal.SIGTERM, lambda s, f: got.append("SIGTERM"))
deadline = time.time() + 30
while not got and time.time() < deadline:
    time.sleep(0.01)
print("got", got[0] if got else None, flush=True)
"""


def test_kind_and_window_follow_the_launchers_variables():
    assert launchers.kind({"OMPI_COMM_WORLD_SIZE": "2"}) == "mpirun"
    assert launchers.kind({"HOROVOD_RANK": "0"}) == "gloo"
    assert launchers.kind({"TORCHELASTIC_RUN_ID": "x", "RANK": "0"}) == "torchrun"
    assert launchers.kind({"PMIX_RANK": "0"}) is None and launchers.kind({}) is None
    mpi = {"OMPI_COMM_WORLD_SIZE": "2"}
    assert launchers.stop_window(mpi) == 2.0 and launchers.stop_window(mpi, relayed=False) == 1.0
    assert launchers.stop_window({**mpi, "OMPI_MCA_odls_base_sigkill_timeout": "30"}) == 60.0
    assert launchers.stop_window({"HOROVOD_RANK": "0"}) == 5.0 and launchers.stop_window({}) is None


def test_a_stop_that_does_not_fit_is_named_with_the_launch_that_fits():
    mpi = {"OMPI_COMM_WORLD_SIZE": "2"}
    assert launchers.window_note(mpi, step_s=0.05, save_s=0.1) is None
    note = launchers.window_note(mpi, step_s=1.5, save_s=0.3)
    assert note.startswith("note: mpirun kills a job's ranks 2 s after Ctrl-C or SIGTERM; a stop of this run needs "
                           "about 3.3 s") and "odls_base_sigkill_timeout 30" in note and "\n" not in note
    assert launchers.window_note({**mpi, "OMPI_MCA_odls_base_sigkill_timeout": "30"}, 1.5, 0.3) is None
    assert "torchrun" in launchers.window_note({"HOROVOD_RANK": "0"}, 1.5, 0.3)
    assert launchers.window_note({}, 100.0, 100.0) is None


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_relay_passes_the_launcher_groups_signal_on_to_its_rank(signum):
    """A launcher (a session of its own, like a terminal's job) starts a rank in a process group
    of its own, as mpirun does; Ctrl-C or kill to the launcher's group then reaches the rank
    only through its relay, at once; the relay ends with the rank."""
    launcher = subprocess.Popen([sys.executable, "-c", f"""
import os, subprocess, sys
env = {{**os.environ, "OMPI_COMM_WORLD_SIZE": "2", "PYTHONPATH": {str(REPO)!r}}}
rank = subprocess.Popen([sys.executable, "-c", {RANK!r}], env=env, process_group=0)
print("rank", rank.pid, flush=True)
sys.exit(rank.wait())
"""], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        rank = int(launcher.stdout.readline().split()[1])
        relay = int(launcher.stdout.readline().split()[1])
        deadline = time.time() + 20
        while os.getpgid(relay) != os.getpgid(launcher.pid) and time.time() < deadline:
            time.sleep(0.01)   # the relay joins the launcher's group as it starts
        assert os.getpgid(rank) == rank != os.getpgid(launcher.pid) == os.getpgid(relay), "not mpirun's layout"
        os.killpg(launcher.pid, signum)   # the launcher itself has no handler: it ends, the rank does not
        assert launcher.stdout.readline().split() == ["got", signal.Signals(signum).name]
        deadline = time.time() + 10
        while os.path.exists(f"/proc/{relay}") and _state(relay) != "Z" and time.time() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{relay}") or _state(relay) == "Z", "the relay outlived its rank"
    finally:
        launcher.kill()
        launcher.wait()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_no_relay_outside_mpirun_or_when_turned_off():
    assert launchers.start_relay({}) is None
    assert launchers.start_relay({"OMPI_COMM_WORLD_SIZE": "2", "REDSYNC_RELAY": "0"}) is None
    # this test process leads no group of its own inside its parent's: nothing to relay
    assert os.getpgid(0) != os.getpid() or launchers.start_relay({"OMPI_COMM_WORLD_SIZE": "2"}) is None


def test_a_repeated_signal_is_ignored_under_a_launcher_and_ends_a_plain_process():
    """mpirun follows the relayed Ctrl-C with its own SIGTERM: under a launcher the first signal
    counts and the process lives on to save; a plain process ends on the second one."""
    ctl = StopController(lambda v: v, checkpoint_every_s=0, force_on_repeat=False).install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert ctl.decide(ctl.flags()) == (True, True, "SIGINT") and ctl.heard_at is not None
    finally:
        ctl.uninstall()
    plain = subprocess.run([sys.executable, "-c", """
import os, signal, time
from redsync_hvd.preemption import StopController
ctl = StopController(lambda v: v, checkpoint_every_s=0).install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.05)
print("first one only flagged", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("survived")
"""], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert plain.returncode == -signal.SIGTERM and plain.stdout == "first one only flagged\n", plain


def test_a_rank_whose_launcher_is_gone_stops_as_on_sigterm(tmp_path):
    """The launcher killed (SIGKILL, the OOM killer): its ranks lose their parent, nothing will
    signal them; the parent watch asks for a stop within a second."""
    child = subprocess.run([sys.executable, "-c", """
import os, subprocess, sys, time
orphan = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
from redsync_hvd.preemption import StopController
ctl = StopController(lambda v: v, checkpoint_every_s=0).watch_parent(interval=0.1)
print("watching", flush=True)
deadline = time.time() + 20
while not ctl.signum and time.time() < deadline:
    time.sleep(0.05)
with open(sys.argv[1], "w") as f:
    f.write(str(ctl.decide(ctl.flags()).reason))
''', sys.argv[1]], stdout=subprocess.PIPE, text=True)
orphan.stdout.readline()
os._exit(0)   # the launcher is gone
""", str(tmp_path / "reason")], env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert child.returncode == 0
    out = tmp_path / "reason"
    deadline = time.time() + 30
    while not (out.exists() and out.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    assert out.read_text() == "SIGTERM"


def test_output_to_a_closed_pipe_is_dropped_not_raised():
    r, w = os.pipe()
    os.close(r)
    stream = QuietStream(os.fdopen(w, "w"))
    assert stream.write("x" * 100_000) == 100_000
    stream.flush()
    assert stream.broken and stream.write("more") == 4 and not stream.isatty()
