"""TensorFlow, N workers, our tape (or Keras optimizer) with method none (and topk at density 1)
== single-process SGD on the concatenated batches.

argv: compression JSON, mode: eager (tape, eager) | function (tape inside tf.function, the
exchange in tf.py_function) | keras (DistributedOptimizer.apply_gradients in tf.function) |
fit (DistributedOptimizer in model.fit)
"""
import json
import sys

import numpy as np
import tensorflow as tf

import redsync_hvd.tensorflow as rhvd


def make_model():
    tf.keras.utils.set_random_seed(1)
    return tf.keras.Sequential([tf.keras.Input(shape=(20,)), tf.keras.layers.Dense(32, activation="tanh"),
                                tf.keras.layers.Dense(5)])


def main(compression, mode):
    rhvd.init()
    rank, size = rhvd.rank(), rhvd.size()
    rng = np.random.default_rng(123)
    per, steps = 8, 6
    X = rng.standard_normal((steps, size * per, 20)).astype(np.float32)   # same on every rank
    Y = rng.integers(0, 5, (steps, size * per))
    model, ref = make_model(), make_model()
    lossf = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    named = [(f"v{i}", v) for i, v in enumerate(model.trainable_variables)]
    rhvd.broadcast_variables(model.variables, root_rank=0)
    ref_opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    mine = slice(rank * per, (rank + 1) * per)

    if mode in ("eager", "function"):
        opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = lossf(y, model(x, training=True))
            tape = rhvd.DistributedGradientTape(tape, compression=compression, named_variables=named)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        if mode == "function":
            step = tf.function(step)
        for s in range(steps):
            step(X[s, mine], Y[s, mine])
        from redsync_hvd.tensorflow.exchange import exchange_for
        stats = exchange_for(model.trainable_variables, compression, named).communication_stats()
    else:
        opt = rhvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), compression=compression,
                                        named_variables=named)
        if mode == "keras":
            @tf.function
            def step(x, y):
                with tf.GradientTape() as tape:
                    loss = lossf(y, model(x, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
            for s in range(steps):
                step(X[s, mine], Y[s, mine])
        else:
            model.compile(optimizer=opt, loss=lossf)
            model.fit(X[:, mine].reshape(-1, 20), Y[:, mine].reshape(-1), batch_size=per, epochs=1, shuffle=False,
                      verbose=0)
        stats = opt.communication_stats()

    for s in range(steps):
        with tf.GradientTape() as tape:
            loss = lossf(Y[s], ref(X[s], training=True))
        grads = tape.gradient(loss, ref.trainable_variables)
        ref_opt.apply_gradients(zip(grads, ref.trainable_variables))
    for (name, p), q in zip(named, ref.trainable_variables):
        err = float(tf.reduce_max(tf.abs(p - q)))
        assert err < 1e-5, f"{compression} {mode}: {name} differs from single-process SGD by {err}"
    assert stats["steps"] == steps and stats["wire_bytes"] > 0 and stats["dense_bytes"] > 0, stats
    if compression["method"] == "none":
        # fp32 values plus one 4-byte finite-check scalar per step, as in torch
        assert stats["wire_bytes"] == stats["dense_bytes"] + steps * 4, stats
    print(f"rank {rank}: OK tf {mode} {compression}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "eager")
    from _tf_exit import exit_cleanly
    exit_cleanly()
