"""The pydoc GPT (configs/pydoc/gpt.yaml, made tiny) under AdamW, trained by the YAML runner once per
compression method in one job, so the launcher and the frameworks start once:
``horovodrun -np 2 python gpt_methods.py horovod OUT`` or
``torchrun --nproc_per_node 2 gpt_methods.py ddp OUT``. Each run writes OUT/<engine>-<method>."""
import sys
from pathlib import Path

import torch.distributed as dist

from redsync_hvd.config import load_config
from redsync_hvd.launchers import close_process_group
from redsync_hvd.torch.training import DDPAdapter, HorovodAdapter
from redsync_hvd.train import launch

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "pydoc" / "gpt.yaml"
TINY = ["model.options={d_model: 32, n_layers: 1, n_heads: 2, dropout: 0.1}", "data.options.seq_len=16",
        "training.steps=6", "training.batch_size=8", "training.eval_every=0", "training.log_every=2",
        "training.progress=false", "optimizer.schedule.warmup_fraction=0.3"]
METHODS = {"redsync": ["compression.method=redsync", "compression.density=0.01"],
           "topk": ["compression.method=topk", "compression.density=0.01"],
           "powersgd": ["compression.method=powersgd", "compression.rank=1", "compression.start_iter=2"]}


class JoinedDDP(DDPAdapter):
    """The DDP adapter; the process group of the first run serves the next ones."""

    def init(self, cfg):
        if dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return super().init(cfg)


engine, out = sys.argv[1], sys.argv[2]
for method, overrides in METHODS.items():
    cfg = load_config(CONFIG, [*TINY, *overrides, f"engine={engine}", f"output.dir={out}",
                               f"output.name={engine}-{method}"])
    code = launch(cfg, JoinedDDP() if engine == "ddp" else HorovodAdapter())
    assert code == 0, (method, code)
    print(f"OK {engine} {method}", flush=True)
if engine == "ddp":
    close_process_group(0)
