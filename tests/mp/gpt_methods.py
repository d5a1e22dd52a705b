"""The pydoc GPT (configs/pydoc/gpt.yaml, made tiny) under AdamW, trained by the YAML runner once per
compression method in one job, so the launcher and the frameworks start once:
``horovodrun -np 2 python gpt_methods.py horovod OUT`` or
``torchrun --nproc_per_node 2 gpt_methods.py ddp OUT`` (then redsync under engine: fsdp as well).
Each run writes OUT/<engine>-<method>."""
import sys
from pathlib import Path

import torch.distributed as dist

from redsync_hvd.config import load_config
from redsync_hvd.launchers import close_process_group
from redsync_hvd.torch.training import DDPAdapter, FSDPAdapter, HorovodAdapter
from redsync_hvd.train import launch

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "pydoc" / "gpt.yaml"
TINY = ["model.options={d_model: 32, n_layers: 1, n_heads: 2, dropout: 0.1}", "data.options.seq_len=16",
        "training.steps=6", "training.batch_size=8", "training.eval_every=0", "training.log_every=2",
        "training.progress=false", "optimizer.schedule.warmup_fraction=0.3"]
# redsync every step (local_steps: 1): the per-step exchange in AdamW's units, the same on every engine;
# its default, local_steps: auto, takes 8 local steps under horovodrun (tests/test_training_runs.py)
METHODS = {"redsync": ["compression.method=redsync", "compression.density=0.01", "compression.local_steps=1"],
           "topk": ["compression.method=topk", "compression.density=0.01"],
           "powersgd": ["compression.method=powersgd", "compression.rank=1", "compression.start_iter=2"],
           "redsync-gradient": ["compression.method=redsync", "compression.density=0.01",
                                "compression.feedback_units=gradient", "compression.local_steps=1"],
           "dct": ["compression.method=dct", "compression.density=0.01"],
           "demo": ["compression.method=dct", "compression.density=0.01", "compression.decay=0.999",
                    "compression.sign_step=true"]}


def joined(adapter):
    """A torch.distributed adapter whose process group, once started, serves the next runs."""
    class Joined(adapter):
        def init(self, cfg):
            if dist.is_initialized():
                return dist.get_rank(), dist.get_world_size()
            return super().init(cfg)
    return Joined()


engine, out = sys.argv[1], sys.argv[2]
runs = [(engine, method) for method in METHODS]
if engine == "ddp":   # FSDP2's compressed reduce-scatter runs redsync and topk; it keeps no Adam moments
    runs += [("fsdp", "redsync")]
for run_engine, method in runs:
    cfg = load_config(CONFIG, [*TINY, *METHODS[method], f"engine={run_engine}", f"output.dir={out}",
                               f"output.name={run_engine}-{method}"])
    adapter = HorovodAdapter() if run_engine == "horovod" else \
        joined(FSDPAdapter if run_engine == "fsdp" else DDPAdapter)
    code = launch(cfg, adapter)
    assert code == 0, (run_engine, method, code)
    print(f"OK {run_engine} {method}", flush=True)
if engine == "ddp":
    close_process_group(0)
