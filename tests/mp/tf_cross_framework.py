"""The same compression config in torch and in TensorFlow, fed the same gradients, selects the
same indices and sends the same messages, step after step (residuals, thresholds and DGC
velocities included), and both frameworks end with the same averaged gradients.

torch: redsync_hvd.torch.DistributedOptimizer with .grad set by hand.
TF: redsync_hvd.tensorflow.DistributedGradientTape on loss = sum(v * G), whose gradient is G.
argv: compression JSON.
"""
import json
import sys

import numpy as np
import tensorflow as tf
import torch

import redsync_hvd.tensorflow as rhvd_tf
import redsync_hvd.torch as rhvd_torch

SPEC = [("fc.weight", (96, 80)), ("fc.bias", (80,)), ("conv.weight", (16, 8, 3, 3))]


def record(compressor, log):
    """Wrap compressor.compress to keep every message it produces, with the positions that are not
    in the message (randomk's shared seed, IWP's leader's broadcast) from its ctx."""
    inner = compressor.compress

    def compress(x, layer, step, scan=None):
        msg = inner(x, layer, step, scan)
        extra = [] if msg.ctx is None else [msg.ctx.detach().clone().to(torch.int64)]
        log.append((step, layer.name, [t.detach().clone() for t in msg.tensors] + extra))
        return msg
    compressor.compress = compress


def main(compression):
    rhvd_tf.init()
    assert rhvd_tf.rank() == rhvd_torch.rank() and rhvd_tf.size() == rhvd_torch.size()
    rank = rhvd_torch.rank()
    rng = np.random.default_rng(7 + rank)    # each rank its own gradients, as in real training
    steps = 5
    grads = [{n: (rng.standard_normal(shape) * (1 + 0.3 * i)).astype(np.float32) for i, (n, shape) in enumerate(SPEC)}
             for _ in range(steps)]

    # torch
    params = {n: torch.nn.Parameter(torch.zeros(shape)) for n, shape in SPEC}
    t_opt = rhvd_torch.DistributedOptimizer(torch.optim.SGD(params.values(), lr=0.1, momentum=0.9),
                                            named_parameters=list(params.items()), compression=compression)
    t_log, t_out = [], []
    record(t_opt.exchange.compressor, t_log)
    for s in range(steps):
        for n, p in params.items():
            p.grad = torch.from_numpy(grads[s][n].copy())
        t_opt.synchronize()
        t_out.append({n: p.grad.clone() for n, p in params.items()})
        with t_opt.skip_synchronize():
            t_opt.step()

    # TensorFlow
    variables = {n: tf.Variable(tf.zeros(shape), name=n.replace(".", "_")) for n, shape in SPEC}
    named = list(variables.items())
    k_opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    f_log, f_out = [], []
    # the exchange the tape will find (one per compression, variables and optimizer), to record it
    from redsync_hvd.tensorflow.exchange import exchange_for
    ex = exchange_for([v for _, v in named], compression, named, k_opt)
    record(ex.exchange.compressor, f_log)
    for s in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * grads[s][n]) for n, v in named])
        tape = rhvd_tf.DistributedGradientTape(tape, compression=compression, named_variables=named,
                                               optimizer=k_opt)
        g = tape.gradient(loss, [v for _, v in named])
        assert tape.exchange is ex
        f_out.append({n: torch.from_numpy(x.numpy()) for (n, _), x in zip(named, g)})
        k_opt.apply_gradients(zip(g, [v for _, v in named]))
    assert tape.exchange.exchange.compressor is not t_opt.exchange.compressor   # two instances, one class
    assert type(tape.exchange.exchange.compressor) is type(t_opt.exchange.compressor)

    t_msgs = {(s, n): ts for s, n, ts in t_log}
    f_msgs = {(s, n): ts for s, n, ts in f_log}
    assert t_msgs.keys() == f_msgs.keys() and t_msgs, (sorted(t_msgs)[:5], sorted(f_msgs)[:5])
    sparse = 0
    for key in t_msgs:
        for a, b in zip(t_msgs[key], f_msgs[key]):
            assert a.dtype == b.dtype and a.shape == b.shape, (key, a.shape, b.shape)
            if a.dtype in (torch.int32, torch.int64, torch.uint8):
                assert torch.equal(a, b), f"{compression}: different indices at {key}"
                sparse += 1
            else:
                assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), f"{compression}: different values at {key}"
    for s in range(steps):
        for n, _ in SPEC:
            assert torch.allclose(t_out[s][n], f_out[s][n], atol=1e-6, rtol=1e-5), (s, n)
    t_res = t_opt.exchange.state_dict()["memory"]
    f_res = tape.exchange.state_dict()["memory"]
    if t_res:
        for kind in t_res:
            for n in t_res[kind]:
                assert torch.allclose(t_res[kind][n], f_res[kind][n], atol=1e-6), (kind, n)
    print(f"rank {rank}: OK cross-framework {compression['method']} ({sparse} index tensors identical)")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    from _tf_exit import exit_cleanly
    exit_cleanly()
