"""docs/tensorflow.md's GradientTape snippet, as a complete script: redsync_hvd.tensorflow under
horovodrun (TensorFlow 2; gradients travel through the same exchange as PyTorch's, by DLPack).

    horovodrun -np 2 -H localhost:2 python examples/tf_tape.py

Each worker fits a linear classifier to samples of its own (class c: feature c is 1, the rest
noise of about unit norm in all); RedSync sends 1% of the weight matrix's gradient per step.
Rank 0 prints the loss every 20 steps and the exchange's figures at the end.
"""
import json

import tensorflow as tf

import redsync_hvd.tensorflow as rhvd

STEPS = 100

rhvd.init()
tf.random.set_seed(0)
model = tf.keras.Sequential([tf.keras.Input((1000,)), tf.keras.layers.Dense(10)])
opt = tf.keras.optimizers.SGD(0.5)
rhvd.broadcast_variables(model.variables, root_rank=0)


def step(x, y):                     # eager here; under @tf.function it works the same
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True))
    tape = rhvd.DistributedGradientTape(tape, compression={"method": "redsync", "density": 0.01,
                                                           "dgc": {"momentum_correction": False}})
    grads = tape.gradient(loss, model.trainable_variables)   # one exchange per config and variables:
    opt.apply_gradients(zip(grads, model.trainable_variables))   # residuals carry over between steps
    return loss, tape


data = tf.random.Generator.from_seed(1 + rhvd.rank())   # each rank its own samples
for i in range(STEPS + 1):
    y = data.uniform((64,), 0, 10, dtype=tf.int64)              # class c: feature c is 1, plus noise
    x = data.normal((64, 1000)) / 1000 ** 0.5 + tf.one_hot(y, 1000)
    loss, tape = step(x, y)
    if rhvd.rank() == 0 and i % 20 == 0:
        print(f"step {i} loss {float(loss):.4f}", flush=True)
if rhvd.rank() == 0:
    print("communication_stats:", json.dumps(tape.communication_stats(), default=str), flush=True)
