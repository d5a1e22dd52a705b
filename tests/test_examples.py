"""examples/: the README's and docs/tensorflow.md's snippets as complete scripts, each launched as
its docstring says, on 2 workers. Each must print a loss that falls and communication_stats()
with compressed traffic."""
import importlib.util
import json
import re

import pytest
from launch import REPO, horovodrun, torchrun

TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:")
TF = importlib.util.find_spec("tensorflow") is not None
# script, launcher, least compression ratio: RedSync at density 0.001 or 0.01 on a 1000 x 10 matrix
# whose bias goes dense; each sent element costs an index and an fp16 value (6 bytes against 4
# dense), so 0.001 lands near 270x and 0.01 near 43x. Under horovodrun and the DDP hook the default
# local steps send 0.1 of the delta every 8 steps with Golomb-coded positions and, under SGD, int8
# values (about 150x here)
EXAMPLES = [
    ("torch_horovod.py", "horovodrun", 60),
    ("torch_ddp.py", "torchrun", 60),
    pytest.param("tf_tape.py", "horovodrun", 30, marks=pytest.mark.skipif(not TF, reason="needs TensorFlow")),
    pytest.param("keras_fit.py", "horovodrun", 30, marks=pytest.mark.skipif(not TF, reason="needs TensorFlow")),
]


@pytest.mark.parametrize("script, launcher, ratio", EXAMPLES)
def test_each_example_runs_on_two_workers_and_prints_its_loss_and_stats(script, launcher, ratio):
    path = REPO / "examples" / script
    if launcher == "torchrun":
        res = torchrun([path], nproc=2, timeout=300)
    else:
        res = horovodrun(["python", path], np=2, timeout=300)
    text = TAG.sub("", res.stdout)
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([\d.]+)$", text, re.MULTILINE)]
    assert len(losses) >= 5 and losses[-1] < 0.8 * losses[0], text[-3000:]
    stats = json.loads(re.search(r"^communication_stats: (\{.*\})$", text, re.MULTILINE).group(1))
    assert stats["steps"] >= 100 and stats["wire_bytes"] > 0 and stats["compression_ratio"] > ratio, stats
    assert "Traceback" not in text, text[-3000:]
