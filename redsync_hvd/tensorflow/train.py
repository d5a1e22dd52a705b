"""Training with TensorFlow from the same YAML configs (``framework: tensorflow``).

    horovodrun -np 2 -H localhost:2 python -m redsync_hvd.tensorflow.train \
        --config configs/digits/tf-redsync.yaml [--set compression.density=0.01 ...]

(``python -m redsync_hvd.train`` dispatches here for ``framework: tensorflow`` configs.)

Same config, same data (:func:`redsync_hvd.data.build_datasets`, as numpy), same models
(Keras twins of the torch ``mlp``/``cnn`` with the torch initial weights), same schedule,
same run folder (``metrics.jsonl``, ``summary.json`` with the same keys, one checkpoint per
rank). The optimizer update follows torch's SGD/Adam formulas exactly (L2 weight decay in the
gradient, ``buf = m*buf + g``), so a TF run and a torch run of one config are the same algorithm.

One training step is one ``tf.function``: forward, backward, the gradient exchange (through
:func:`redsync_hvd.tensorflow.DistributedGradientTape`, run by ``tf.py_function``) and the update.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np


def main(argv=None) -> int:
    from ..config import ConfigError, load_config
    from ..train import parse_args
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)  # validate before any collective starts
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.framework != "tensorflow":
        print(f"error: {args.config} says framework: {cfg.framework}; this entry point trains framework: tensorflow "
              "configs (add `framework: tensorflow` or --set framework=tensorflow)", file=sys.stderr)
        return 2
    return run(cfg)


def run(cfg) -> int:
    threads = cfg.training.threads
    try:
        import tensorflow as tf

        import redsync_hvd.tensorflow as rhvd
    except ImportError as exc:
        print(f"error: framework: tensorflow: {exc}", file=sys.stderr)
        return 2
    import torch
    from torch.utils.data import DataLoader

    from ..config import ConfigError
    from ..data import build_datasets
    from ..runlog import RunLog, rank_checkpoint
    from ..train import (build_summary, eval_due, log_train_step, lr_lambda, print_layer_decisions,
                         total_steps)
    from .models import build_keras_model

    rhvd.init(tensorflow_horovod=False)
    rank, size = rhvd.rank(), rhvd.size()
    # workers sharing a host split its cores (TF's pools must be sized before its first op)
    n = threads or max(1, (os.cpu_count() or 1) // rhvd.local_size())
    torch.set_num_threads(n)
    tf.config.threading.set_intra_op_parallelism_threads(n)
    tf.config.threading.set_inter_op_parallelism_threads(max(2, n))
    prints = rhvd.allgather_object(cfg.fingerprint(), name="rsync.cfg")
    if len(set(prints)) != 1:
        raise ConfigError(f"ranks loaded different configs (fingerprints {prints}); start every rank with the "
                          "same --config and --set arguments")
    tf.random.set_seed(cfg.training.seed)
    try:
        data = build_datasets(cfg.data.name, path=cfg.data.path, rank=rank, size=size, seed=cfg.training.seed,
                              **cfg.data.options)
        if data.task != "classification":
            raise ValueError(f"framework: tensorflow trains classification data; {cfg.data.name!r} is {data.task!r}")
        model, named, _ = build_keras_model(cfg.model.name, data.num_classes, data.input_shape,
                                            seed=cfg.training.seed, **cfg.model.options)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"error (rank {rank}): {exc}", file=sys.stderr)
        return 2
    x_train, y_train = _numpy(data.train)
    x_test, y_test = _numpy(data.test)
    variables = [v for _, v in named]
    o = cfg.optimizer
    lr0 = o.lr * (size if o.scale_lr_by_workers else 1)
    mc = bool(getattr(cfg.compression, "momentum_correction", False))
    opt = TorchStyleOptimizer(variables, o.name, momentum=0.0 if mc else o.momentum, nesterov=o.nesterov,
                              weight_decay=0.0 if mc else o.weight_decay)
    compression = cfg.compression.model_dump()
    exchange = rhvd.TFGradientExchange(named, compression, momentum=o.momentum if mc else None,
                                       nesterov=o.nesterov)
    pre_decay = o.weight_decay if mc else 0.0   # torch: with momentum correction wd joins g before the memory
    rhvd.broadcast_variables(variables, root_rank=0)

    batch = cfg.training.batch_size
    # the torch trainer's batch order exactly: the same DataLoader sampler and seeded generator, over indices
    gen = torch.Generator().manual_seed(cfg.training.seed * 1000 + rank)
    loader = DataLoader(range(len(x_train)), batch_size=batch, shuffle=True, drop_last=True, generator=gen)
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        print(f"error: training.batch_size={batch} exceeds this rank's shard ({len(x_train)} samples); lower it",
              file=sys.stderr)
        return 2
    total = total_steps(cfg, steps_per_epoch)
    factor = lr_lambda(cfg, steps_per_epoch)
    exchange.set_steps_per_epoch(steps_per_epoch)
    if rank == 0:
        print_layer_decisions(exchange.layer_decisions())
    log = RunLog(cfg.output.dir, cfg.output.name or "run", rank)
    log.write_config(cfg.to_dict())

    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(autograph=False)
    def train_step(x, y, lr):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
            objective = loss
            if pre_decay:   # torch adds wd * w to the gradient before the memory: d/dw of wd/2 |w|^2
                objective = loss + 0.5 * pre_decay * tf.add_n([tf.reduce_sum(tf.square(v)) for v in variables])
        tape = rhvd.DistributedGradientTape(tape, exchange=exchange)
        grads = tape.gradient(objective, variables)
        opt.apply(grads, lr)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=y.dtype), y), tf.int32))
        return loss, correct

    @tf.function(autograph=False)
    def eval_step(x, y):
        logits = model(x, training=False)
        losses = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=y.dtype), y), tf.float64))
        return tf.reduce_sum(tf.cast(losses, tf.float64)), correct

    def evaluate():
        idx = np.arange(rank, len(x_test), size)
        tot = np.zeros(3)
        bs = max(256, batch)
        for s in range(0, len(idx), bs):
            part = idx[s:s + bs]
            loss_sum, correct = eval_step(x_test[part], y_test[part])
            tot += [float(loss_sum), float(correct), len(part)]
        tot = rhvd.allreduce(tf.constant(tot), average=False, name="rsync.eval").numpy()
        return {"test_loss": tot[0] / max(1, tot[2]), "test_accuracy": tot[1] / max(1, tot[2])}

    step = 0
    if cfg.training.resume:
        ckpt = torch.load(rank_checkpoint(cfg.training.resume, rank), weights_only=False)
        if ckpt.get("framework") != "tensorflow":
            print("error: training.resume points at a torch checkpoint; resume a framework: tensorflow run",
                  file=sys.stderr)
            return 2
        for (name, v) in named:
            v.assign(ckpt["model"][name])
        opt.load_state(ckpt["optimizer"])
        exchange.load_state_dict(ckpt["redsync"])
        gen.set_state(ckpt["generator"])
        step = ckpt["step"]

    def save(keep: bool = False):
        blob = {"framework": "tensorflow", "model": {n: v.numpy() for n, v in named},
                "optimizer": opt.state(), "redsync": exchange.state_dict(), "generator": epoch_rng,
                "step": step, "config": cfg.to_dict()}
        torch.save(blob, log.checkpoint_path())
        if keep:
            torch.save(blob, log.dir / f"checkpoint-step{step}-rank{rank}.pt")

    bar = None
    if rank == 0 and cfg.training.progress:
        from tqdm import tqdm
        bar = tqdm(total=total, initial=step, desc=cfg.output.name, unit="step", file=sys.stderr)
    t_start, t_eval, result, epoch_rng = time.perf_counter(), 0.0, {}, gen.get_state()
    while step < total:
        skip = step % steps_per_epoch
        epoch_rng = gen.get_state()   # the loader draws this epoch's order from here; a resume replays it
        for i, idx in enumerate(loader):
            if i < skip:
                continue
            part = idx.numpy()
            lr = lr0 * factor(step)
            loss, correct = train_step(x_train[part], y_train[part], tf.constant(lr, tf.float32))
            loss = float(loss)
            step += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}")
            if step % cfg.training.log_every == 0 or step == total:
                log_train_step(log, exchange.communication_stats(), step, steps_per_epoch, loss,
                               int(correct) / len(part), lr0 * factor(step))
            if eval_due(cfg, step, steps_per_epoch, total):
                t0 = time.perf_counter()
                result = evaluate()
                t_eval += time.perf_counter() - t0
                log.metrics({"step": step, "epoch": step / steps_per_epoch, **result,
                             "wire_bytes": exchange.communication_stats()["wire_bytes"]})
            if cfg.training.checkpoint_every and step % cfg.training.checkpoint_every == 0:
                save(keep=True)
            if step >= total:
                break
    if bar is not None:
        bar.close()
    save()
    wall = time.perf_counter() - t_start
    summary = build_summary(cfg, result, exchange.communication_stats(), exchange.layer_decisions(), step, size,
                            wall, t_eval)
    log.summary(summary)
    log.close()
    if rank == 0:
        print(f"done: {log.dir} accuracy={summary['final_accuracy']:.4f} wire_bytes={summary['wire_bytes']} "
              f"ratio={summary['compression_ratio']:.1f} (framework tensorflow)")
    return 0


def _numpy(dataset):
    """(inputs NHWC float32, int64 targets) of an in-memory dataset, with its transform applied once."""
    import torch
    if getattr(dataset, "transform", None) is None and hasattr(dataset, "tensors"):
        x, y = dataset.tensors
    else:
        pairs = [dataset[i] for i in range(len(dataset))]
        x, y = torch.stack([p[0] for p in pairs]), torch.as_tensor([int(p[1]) for p in pairs])
    x = x.float().numpy()
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim == 4:
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    return x, y.numpy().astype(np.int64)


class TorchStyleOptimizer:
    """torch.optim.SGD / Adam update rules on TF variables (so TF and torch runs are the same
    algorithm): L2 weight decay added to the gradient, SGD ``buf = m*buf + g`` (first step
    ``buf = g``), Nesterov ``d = g + m*buf``; Adam with torch's bias correction and eps."""

    def __init__(self, variables, name="sgd", momentum=0.0, nesterov=False, weight_decay=0.0,
                 betas=(0.9, 0.999), eps=1e-8):
        import tensorflow as tf
        self.variables, self.name = list(variables), name
        self.momentum, self.nesterov, self.weight_decay = float(momentum), bool(nesterov), float(weight_decay)
        self.betas, self.eps = betas, eps
        zeros = lambda: [tf.Variable(tf.zeros_like(v), trainable=False) for v in self.variables]  # noqa: E731
        self.slots = {}
        if name == "adam":
            self.slots = {"m": zeros(), "v": zeros()}
        elif self.momentum:
            self.slots = {"buf": zeros()}
        self.t = tf.Variable(0, dtype=tf.int64, trainable=False)

    def apply(self, grads, lr):
        import tensorflow as tf
        self.t.assign_add(1)
        t = tf.cast(self.t, tf.float32)
        for i, (g, v) in enumerate(zip(grads, self.variables)):
            if self.weight_decay:
                g = g + self.weight_decay * v
            if self.name == "adam":
                b1, b2 = self.betas
                m, s = self.slots["m"][i], self.slots["v"][i]
                m.assign(b1 * m + (1 - b1) * g)
                s.assign(b2 * s + (1 - b2) * tf.square(g))
                denom = tf.sqrt(s) / tf.sqrt(1 - tf.pow(b2, t)) + self.eps
                v.assign_sub(lr / (1 - tf.pow(b1, t)) * m / denom)
                continue
            if self.momentum:
                buf = self.slots["buf"][i]
                buf.assign(self.momentum * buf + g)
                g = g + self.momentum * buf if self.nesterov else buf
            v.assign_sub(lr * g)

    def state(self) -> dict:
        return {"t": int(self.t.numpy()), **{k: [s.numpy() for s in vs] for k, vs in self.slots.items()}}

    def load_state(self, state: dict) -> None:
        self.t.assign(state["t"])
        for k, vs in self.slots.items():
            for s, value in zip(vs, state[k]):
                s.assign(value)


if __name__ == "__main__":
    sys.exit(main())
