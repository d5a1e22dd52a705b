"""What a new user meets in the first hour, tried as the user does: real horovodrun launches of the
runner, a wrapper (``timeout``) that passes Ctrl-C on a second time, Ctrl-C while the ranks start,
a second run into a folder that holds one, and the log a run leaves when its output is a file.

Each check needs the project's virtualenv as scripts/install.sh leaves it: its ``redsync_hvd.pth``
makes horovodrun's process wait for its job and hides TensorFlow's C++ start-up lines.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

from launch import BIN, REPO, _env, finish, kill_session, rank_pids, start, train

from redsync_hvd import checkpoint
from redsync_hvd.progress import LineProgress

CONFIG = "configs/digits/redsync.yaml"
TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:")


def _lines(text: str) -> list:
    """mpirun's output without its tags, one line per line (a tag can land mid-line)."""
    return [l for l in TAG.sub("\n", text).splitlines() if l.strip()]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _wait(condition, what: str, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.05)


def test_a_run_stopped_under_timeout_keeps_its_hint_and_its_folder_takes_no_second_run(tmp_path):
    """1. ``timeout 300 horovodrun ...`` (progress on, output to a file), SIGINT to its process group
    while training: timeout sends the group SIGINT once more, which ends mpirun at once; horovodrun's
    process still returns only after both ranks ended, and the log holds the resume hint once, the
    progress as plain lines, no TensorFlow start-up line and no traceback. 2. The same command
    again: one error line with the three ways on, the folder untouched. 3. ``output.overwrite=true``
    on one worker: the first run's files are gone, rank 1's checkpoint included."""
    run, log = tmp_path / "redsync", tmp_path / "first.log"
    cmd = ["timeout", "300", str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable, "-m",
           "redsync_hvd.train", "--config", str(REPO / CONFIG), "--set", f"output.dir={tmp_path}",
           "--set", "training.epochs=500"]
    env = {k: v for k, v in _env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                                  "OMPI_MCA_mpi_yield_when_idle": "1"}).items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ranks = rank_pids(proc, 2, timeout=240)
        _wait(lambda: "redsync: step " in log.read_text() or proc.poll() is not None, "a progress line")
        os.killpg(proc.pid, signal.SIGINT)                                                  # 1.
        proc.wait(timeout=120)
        alive = [pid for pid in ranks.values() if not _gone(pid)]
    finally:
        kill_session(proc)
    text = log.read_text()
    assert not alive and proc.returncode != 0, (alive, proc.returncode, text[-3000:])
    stops = [l for l in _lines(text) if l.startswith("stopped at step ")]
    step = json.loads([l for l in (run / "metrics.jsonl").read_text().splitlines() if '"stopped"' in l][-1])["step"]
    assert len(stops) == 1 and stops[0].startswith(f"stopped at step {step} on SIGINT") and \
        f"continue with --set training.resume={run}" in stops[0], text[-3000:]
    assert [checkpoint.load(run, r)["step"] for r in (0, 1)] == [step, step]
    progress = [l for l in _lines(text) if l.startswith("redsync: step ")]
    assert progress and all(re.fullmatch(r"redsync: step \d+/\d+ \(\d+%\), [\d.]+ steps/s, .*", l) for l in progress)
    assert "\r" not in text and "Traceback" not in text and "tensorflow/core" not in text, text[-3000:]

    before = (run / "metrics.jsonl").read_text()                                            # 2.
    again = train(tmp_path, CONFIG, check=False, timeout=240)
    errors = [l for l in _lines(again.stdout) if l.startswith("error: ")]
    assert again.returncode == 2 and len(errors) == 1 and "Traceback" not in again.stdout, again.stdout[-3000:]
    for way in (f"--set training.resume={run}", "--set output.name=", "--set output.overwrite=true"):
        assert way in errors[0], errors
    assert (run / "metrics.jsonl").read_text() == before

    fresh = train(tmp_path, CONFIG, "output.overwrite=true", "training.steps=3", np=1, timeout=240)   # 3.
    assert "[overwrite] removed" in fresh.stdout, fresh.stdout[-3000:]
    assert not checkpoint.latest_path(run, 1).exists() and checkpoint.load(run, 0)["step"] == 3
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 3 and not any(r.get("event") == "stopped" for r in records)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 1 and summary["stops"] == [] and summary["resumes"] == []


def test_ctrl_c_while_the_ranks_start_ends_in_one_line(tmp_path):
    """SIGINT to the launcher's process group as soon as both ranks exist (they are still loading
    Python and torch): one line, from rank 0 or for it, no traceback, nothing written."""
    proc = start(["python", "-m", "redsync_hvd.train", "--config", str(REPO / CONFIG), "--set",
                  f"output.dir={tmp_path}"])
    try:
        rank_pids(proc, 2, timeout=240)
        os.killpg(proc.pid, signal.SIGINT)
    finally:
        done = finish(proc, timeout=120, check=False)
    lines = [l for l in _lines(done.stdout) if "interrupted" in l]
    assert done.returncode != 0 and lines == ["interrupted (SIGINT) while starting, before the first step: nothing "
                                              "was trained or saved"], done.stdout[-3000:]
    assert "Traceback" not in done.stdout and not (tmp_path / "redsync").exists(), done.stdout[-3000:]


def test_progress_into_a_file_is_a_line_every_few_seconds():
    """LineProgress on a fake clock: a line once 5 s of steps have passed, one at the end; the
    postfix set before a step shows with it."""
    class Out:
        def __init__(self):
            self.text = ""

        def write(self, text):
            self.text += text

        def flush(self):
            pass

        def isatty(self):
            return False

    now, out = [0.0], Out()
    bar = LineProgress(440, 0, "redsync", out, every_s=5.0, clock=lambda: now[0])
    for step in range(440):
        now[0] += 0.125                   # 8 steps a second: 55 s
        bar.set_postfix(loss=f"{1 / (step + 1):.3f}", refresh=False)
        bar.update(1)
    bar.close()
    lines = out.text.splitlines()
    assert len(lines) == 11 and len(out.text) < 1000, out.text
    assert lines[0] == "redsync: step 40/440 (9%), 8.0 steps/s, 0:05 elapsed, 0:50 left, loss=0.025", lines[0]
    assert lines[-1] == "redsync: step 440/440 (100%), 8.0 steps/s, 0:55 elapsed, loss=0.002", lines[-1]


def test_compare_runs_prints_aligned_text_or_markdown(tmp_path):
    """scripts/compare_runs.py's documented --markdown, on two summary.json files."""
    for name, method, ratio in (("dense", "none", 1.0), ("redsync", "redsync", 28.04)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({
            "compression": {"method": method}, "final_accuracy": 0.975, "wire_bytes": 93.285e6 / ratio,
            "dense_bytes": 93.284e6, "compression_ratio": ratio, "steps": 440, "wall_time_s": 3.04}))
    runs = [str(tmp_path / "dense"), str(tmp_path / "redsync")]
    script = [sys.executable, str(REPO / "scripts/compare_runs.py")]
    plain = subprocess.run(script + runs, capture_output=True, text=True, timeout=60)
    markdown = subprocess.run(script + ["--markdown"] + runs, capture_output=True, text=True, timeout=60)
    assert plain.returncode == markdown.returncode == 0, plain.stderr + markdown.stderr
    assert plain.stdout.splitlines()[2].split() == ["redsync", "redsync", "0.9750", "3.327", "93.284", "28.0x", "440",
                                                    "3.0"] and "|" not in plain.stdout, plain.stdout
    assert markdown.stdout.splitlines()[1].startswith("|----") and \
        markdown.stdout.splitlines()[3].startswith("| redsync | redsync | 0.9750   | 3.327 "), markdown.stdout
