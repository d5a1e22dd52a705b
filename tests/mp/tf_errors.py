"""Bad inputs give TensorFlow users the same clear errors as torch users:

* a bad compression dict: the same ValueError text, before any collective;
* a NaN gradient on one rank: every rank raises NonFiniteGradientError (same message as torch),
  nothing is applied, residuals stay, training goes on; inside tf.function the same message
  arrives in a tf.errors.OpError and ``exchange.last_error`` is the NonFiniteGradientError;
* a zero-size variable: ValueError "parameter ... has zero elements";
* sbc, decentralized methods (dcd/ecd/...), and momentum_correction without the optimizer:
  clear errors too.
"""
import numpy as np
import tensorflow as tf
import torch

import redsync_hvd.tensorflow as rhvd
import redsync_hvd.torch as rhvd_torch
from redsync_hvd.exchange import NonFiniteGradientError
from redsync_hvd.tensorflow.exchange import exchange_for


def error_of(fn):
    try:
        fn()
    except Exception as exc:   # noqa: BLE001
        return exc
    raise AssertionError(f"{fn} did not raise")


rhvd.init()
rank = rhvd.rank()

# -- bad compression dicts: identical errors ---------------------------------------------------
v = tf.Variable(tf.ones([4, 3]))
for bad in ({"method": "topk", "density": 1.5}, {"method": "topk", "densty": 0.1}, {"method": "nope"},
            {"method": "redsync", "selection": "fastest"}):
    model = torch.nn.Linear(3, 4)
    t_err = error_of(lambda: rhvd_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                             named_parameters=model.named_parameters(),
                                                             compression=bad))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * 2.0)
    f_err = error_of(lambda: rhvd.DistributedGradientTape(tape, compression=bad))
    k_err = error_of(lambda: rhvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=bad))
    assert type(t_err) is type(f_err) is type(k_err) and isinstance(t_err, ValueError), (t_err, f_err, k_err)
    assert str(t_err) == str(f_err) == str(k_err), (str(t_err), str(f_err))
print(f"rank {rank}: OK bad compression dicts: {str(f_err)[:60]}")

# -- zero-size variable --------------------------------------------------------------------------
empty = tf.Variable(tf.zeros([0, 3]), name="empty")
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(v) + tf.reduce_sum(empty)
tape = rhvd.DistributedGradientTape(tape, compression={"method": "topk", "density": 0.5},
                                    named_variables=[("w", v), ("empty", empty)])
f_err = error_of(lambda: tape.gradient(loss, [v, empty]))
p_empty = torch.nn.Parameter(torch.zeros(0, 3))
t_err = error_of(lambda: rhvd_torch.DistributedOptimizer(torch.optim.SGD([p_empty], lr=0.1),
                                                         named_parameters=[("empty", p_empty)],
                                                         compression={"method": "topk", "density": 0.5}))
assert type(f_err) is type(t_err) is ValueError, (f_err, t_err)
head = "has zero elements: there is nothing to exchange."
assert head in str(f_err) and head in str(t_err) and "'empty'" in str(f_err), (str(f_err), str(t_err))
print(f"rank {rank}: OK zero-size variable: {f_err}")

# -- methods the adapter cannot run, and DGC without the optimizer ---------------------------------
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(v * 2.0)
err = error_of(lambda: rhvd.DistributedGradientTape(tape, compression={"method": "sbc"}).gradient(loss, [v]))
assert isinstance(err, NotImplementedError) and "local_steps" in str(err), err
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(v * 2.0)
err = error_of(lambda: rhvd.DistributedGradientTape(tape, compression={"method": "redsync"}).gradient(loss, [v]))
assert isinstance(err, ValueError) and "optimizer=" in str(err) and "momentum_correction" in str(err), err
for method in ("dcd", "ecd"):     # decentralized: no averaged gradient to hand back
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * 2.0)
    for err in (error_of(lambda: rhvd.DistributedGradientTape(tape, compression={"method": method})),
                error_of(lambda: rhvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                                           compression={"method": method}))):
        assert isinstance(err, NotImplementedError) and "decentralized" in str(err), err
        assert "framework: torch" in str(err) and repr(method) in str(err), err
print(f"rank {rank}: OK sbc, decentralized and momentum_correction errors")

# -- NaN on one rank, eager and in tf.function -------------------------------------------------------
tf.keras.utils.set_random_seed(0)
model = tf.keras.Sequential([tf.keras.Input(shape=(64,)), tf.keras.layers.Dense(32)])
variables = model.trainable_variables
named = [("weight", variables[0]), ("bias", variables[1])]
opt = tf.keras.optimizers.SGD(0.1)
compression = {"method": "topk", "density": 0.1}
x = tf.constant(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32) + rank)


def train_step(poison):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x)))
        loss = loss * poison
    tape = rhvd.DistributedGradientTape(tape, compression=compression, named_variables=named)
    grads = tape.gradient(loss, variables)
    opt.apply_gradients(zip(grads, variables))


graph_step = tf.function(train_step)
ex = exchange_for(variables, compression, named)
torch_message = None
for mode, fn in (("eager", train_step), ("function", graph_step)):
    for step in range(4):
        poison = tf.constant(float("nan") if (step == 2 and rank == 1) else 1.0)
        before_w = variables[0].numpy().copy()
        before_r = {k: t.clone() for k, t in ex.exchange.memory.residual.items()}
        try:
            fn(poison)
        except (NonFiniteGradientError, tf.errors.OpError) as exc:
            assert step == 2, f"unexpected error at step {step}: {exc}"
            if mode == "eager":
                assert isinstance(exc, NonFiniteGradientError), type(exc)
            else:
                assert isinstance(ex.last_error, NonFiniteGradientError), ex.last_error
            assert "non-finite" in str(exc) and "residuals were left" in str(exc), exc
            assert np.array_equal(variables[0].numpy(), before_w), "weights changed on a failed step"
            after_r = ex.exchange.memory.residual
            assert all(torch.equal(before_r[k], after_r[k]) for k in before_r), "residual changed on a failed step"
            print(f"rank {rank}: {mode} raised at step 2: {str(ex.last_error)[:80]}")
            continue
        assert step != 2, f"{mode}: NaN step did not raise"
        assert np.isfinite(variables[0].numpy()).all()

# the torch wording, for comparison: the same core, the same text
model_t = torch.nn.Linear(64, 32)
opt_t = rhvd_torch.DistributedOptimizer(torch.optim.SGD(model_t.parameters(), lr=0.1),
                                        named_parameters=model_t.named_parameters(), compression=compression)
model_t(torch.from_numpy(x.numpy())).pow(2).mean().mul(float("nan") if rank == 1 else 1.0).backward()
t_err = error_of(opt_t.step)
assert isinstance(t_err, NonFiniteGradientError)
for e in (t_err, ex.last_error):
    assert str(e).startswith("non-finite gradient (NaN/Inf) at step"), e
# after the step number and where: the same explanation and fix, word for word
assert str(t_err).split(". ", 1)[1] == str(ex.last_error).split(". ", 1)[1], (str(t_err), str(ex.last_error))
print(f"rank {rank}: OK nonfinite handling")
from _tf_exit import exit_cleanly  # noqa: E402

exit_cleanly()
