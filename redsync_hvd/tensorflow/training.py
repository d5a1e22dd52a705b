"""The YAML runner's TensorFlow side (``framework: tensorflow``; runner.py owns the loop).

Same config, same data (as numpy), same models (Keras twins of the torch ``mlp``/``cnn`` with
the torch initial weights), same schedule, same run folder and batch order as the torch side.
The optimizer update follows torch's SGD/Adam/AdamW formulas exactly (L2 weight decay in the
gradient, ``buf = m*buf + g``; AdamW's decay decoupled), so a TF run and a torch run of one config
are the same algorithm.

One training step is one ``tf.function``: forward, backward, the gradient exchange (through
:func:`redsync_hvd.tensorflow.DistributedGradientTape`, run by ``tf.py_function``) and the update.
"""
from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
import torch

from ..config import RunConfig
from ..schedule import lr_factor
from .models import build_keras_model


class HorovodAdapter:
    """Start-up of a TensorFlow process under horovodrun."""
    framework = "tensorflow"

    def __init__(self):
        import redsync_hvd.tensorflow as rhvd
        self.rhvd = rhvd

    def init(self, cfg: RunConfig) -> tuple:
        self.rhvd.init()
        # workers sharing a host split its cores (TF's pools must be sized before its first op)
        n = cfg.training.threads or max(1, (os.cpu_count() or 1) // self.rhvd.local_size())
        torch.set_num_threads(n)
        tf.config.threading.set_intra_op_parallelism_threads(n)
        tf.config.threading.set_inter_op_parallelism_threads(max(2, n))
        tf.random.set_seed(cfg.training.seed)
        return self.rhvd.rank(), self.rhvd.size()

    def allgather_object(self, obj, name: str):
        return self.rhvd.allgather_object(obj, name=name)

    def trainer(self, cfg: RunConfig, data, rank: int, size: int) -> "TFTrainer":
        return TFTrainer(cfg, data, rank, size, self.rhvd)


class TFTrainer:
    framework = "tensorflow"

    def __init__(self, cfg: RunConfig, data, rank: int, size: int, rhvd):
        if data.task != "classification":
            raise ValueError(f"framework: tensorflow trains classification data; {cfg.data.name!r} is {data.task!r}")
        self.cfg, self.rank, self.size, self.rhvd = cfg, rank, size, rhvd
        self.task = data.task
        self.model, self.named, _ = build_keras_model(cfg.model.name, data.num_classes, data.input_shape,
                                                      seed=cfg.training.seed, **cfg.model.options)
        self.x_train, self.y_train = _numpy(data.train)
        self.x_test, self.y_test = _numpy(data.test)
        self.train_size = len(self.x_train)
        variables = [v for _, v in self.named]
        o = cfg.optimizer
        if o.no_decay:
            raise ValueError(f"optimizer.no_decay: {o.no_decay} picks parameters by torch module type; the "
                             "tensorflow trainer decays every variable: remove no_decay, or use framework: torch")
        self.lr0 = o.lr * (size if o.scale_lr_by_workers else 1)
        # as torch's param groups: only SGD has a momentum for the correction to take (Adam: plain residuals)
        mc = cfg.compression.corrects_momentum and o.name == "sgd"
        self.opt = TorchStyleOptimizer(variables, o.name, momentum=0.0 if mc else o.momentum, nesterov=o.nesterov,
                                       weight_decay=0.0 if mc else o.weight_decay, betas=o.betas, eps=o.eps)
        self.exchange = rhvd.TFGradientExchange(self.named, cfg.compression.model_dump(),
                                                momentum=o.momentum if mc else None, nesterov=o.nesterov,
                                                momentum_free=cfg.compression.corrects_momentum and not mc)
        rhvd.broadcast_variables(variables, root_rank=0)
        # torch adds wd * w to the gradient before the memory: d/dw of wd/2 |w|^2
        self._train_step = _train_step(self.model, variables, self.opt, self.exchange, o.weight_decay if mc else 0.0)
        self._eval_step = _eval_step(self.model)
        self.factor = None

    def set_steps_per_epoch(self, steps: int) -> None:
        self.exchange.set_steps_per_epoch(steps)
        self.factor = lr_factor(self.cfg, steps)

    def step(self, indices: torch.Tensor, step: int) -> tuple:
        part = indices.numpy()
        lr = self.lr0 * self.factor(step)
        loss, correct = self._train_step(self.x_train[part], self.y_train[part], tf.constant(lr, tf.float32))
        return float(loss), int(correct), len(part)

    def lr(self, step: int) -> float:
        return self.lr0 * self.factor(step)

    def evaluate(self) -> dict:
        idx = np.arange(self.rank, len(self.x_test), self.size)
        tot = np.zeros(3)
        bs = max(256, self.cfg.training.batch_size)
        for s in range(0, len(idx), bs):
            part = idx[s:s + bs]
            loss_sum, correct = self._eval_step(self.x_test[part], self.y_test[part])
            tot += [float(loss_sum), float(correct), len(part)]
        tot = self.rhvd.allreduce(tf.constant(tot), average=False, name="rsync.eval").numpy()
        return {"test_loss": tot[0] / max(1, tot[2]), "test_accuracy": tot[1] / max(1, tot[2])}

    def state_dict(self) -> dict:
        # torch tensors, not numpy arrays: a checkpoint then loads with torch.load(weights_only=True)
        return {"model": {n: torch.from_numpy(v.numpy()) for n, v in self.named},
                "optimizer": self.opt.state(), "redsync": self.exchange.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for name, v in self.named:
            v.assign(np.asarray(state["model"][name]))
        self.opt.load_state(state["optimizer"])
        self.exchange.load_state_dict(state["redsync"])

    def communication_stats(self) -> dict:
        return self.exchange.communication_stats()

    def layer_decisions(self) -> list:
        return self.exchange.layer_decisions()

    def decision_record(self) -> dict:
        return self.exchange.exchange.decision_record()

    def carrier(self):
        """The GradientExchange whose per-step allreduce can carry the runner's flags."""
        return self.exchange.exchange


def _train_step(model, variables, opt, exchange, pre_decay: float):
    import redsync_hvd.tensorflow as rhvd
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(autograph=False)
    def train_step(x, y, lr):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
            objective = loss
            if pre_decay:
                objective = loss + 0.5 * pre_decay * tf.add_n([tf.reduce_sum(tf.square(v)) for v in variables])
        tape = rhvd.DistributedGradientTape(tape, exchange=exchange)
        grads = tape.gradient(objective, variables)
        opt.apply(grads, lr)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=y.dtype), y), tf.int32))
        return loss, correct
    return train_step


def _eval_step(model):
    @tf.function(autograph=False)
    def eval_step(x, y):
        logits = model(x, training=False)
        losses = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=y.dtype), y), tf.float64))
        return tf.reduce_sum(tf.cast(losses, tf.float64)), correct
    return eval_step


def _numpy(dataset):
    """(inputs NHWC float32, int64 targets) of an in-memory dataset, with its transform applied once."""
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
    """torch.optim.SGD / Adam / AdamW update rules on TF variables (so TF and torch runs are the
    same algorithm): L2 weight decay added to the gradient, SGD ``buf = m*buf + g`` (first step
    ``buf = g``), Nesterov ``d = g + m*buf``; Adam with torch's bias correction and eps; AdamW's
    decay decoupled: ``w *= 1 - lr * wd`` before Adam's step, the gradient untouched."""

    def __init__(self, variables, name="sgd", momentum=0.0, nesterov=False, weight_decay=0.0,
                 betas=(0.9, 0.999), eps=1e-8):
        self.variables, self.name = list(variables), name
        self.momentum, self.nesterov, self.weight_decay = float(momentum), bool(nesterov), float(weight_decay)
        self.betas, self.eps = betas, eps
        zeros = lambda: [tf.Variable(tf.zeros_like(v), trainable=False) for v in self.variables]  # noqa: E731
        self.slots = {}
        if name in ("adam", "adamw"):
            self.slots = {"m": zeros(), "v": zeros()}
        elif self.momentum:
            self.slots = {"buf": zeros()}
        self.t = tf.Variable(0, dtype=tf.int64, trainable=False)

    def apply(self, grads, lr):
        self.t.assign_add(1)
        t = tf.cast(self.t, tf.float32)
        for i, (g, v) in enumerate(zip(grads, self.variables)):
            if self.weight_decay and self.name == "adamw":
                v.assign(v * (1 - lr * self.weight_decay))
            elif self.weight_decay:
                g = g + self.weight_decay * v
            if self.name in ("adam", "adamw"):
                v.assign_sub(self._adam(i, g, t, lr))
                continue
            if self.momentum:
                buf = self.slots["buf"][i]
                buf.assign(self.momentum * buf + g)
                g = g + self.momentum * buf if self.nesterov else buf
            v.assign_sub(lr * g)

    def _adam(self, i, g, t, lr):
        b1, b2 = self.betas
        m, s = self.slots["m"][i], self.slots["v"][i]
        m.assign(b1 * m + (1 - b1) * g)
        s.assign(b2 * s + (1 - b2) * tf.square(g))
        denom = tf.sqrt(s) / tf.sqrt(1 - tf.pow(b2, t)) + self.eps
        return lr / (1 - tf.pow(b1, t)) * m / denom

    def state(self) -> dict:
        return {"t": int(self.t.numpy()), **{k: [torch.from_numpy(s.numpy()) for s in vs]
                                             for k, vs in self.slots.items()}}

    def load_state(self, state: dict) -> None:
        self.t.assign(state["t"])
        for k, vs in self.slots.items():
            for s, value in zip(vs, state[k]):
                s.assign(np.asarray(value))
