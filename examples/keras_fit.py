"""docs/tensorflow.md's Keras form, as a complete script: `model.fit` with
redsync_hvd.tensorflow's DistributedOptimizer, under horovodrun.

    horovodrun -np 2 -H localhost:2 python examples/keras_fit.py

Each worker fits a linear classifier to samples of its own (class c: feature c is 1, the rest
noise of about unit norm in all); RedSync sends 1% of the weight matrix's gradient per step.
Rank 0 prints the loss of each epoch and the exchange's figures at the end.
"""
import json

import tensorflow as tf

import redsync_hvd.tensorflow as rhvd

rhvd.init()
tf.random.set_seed(0)
model = tf.keras.Sequential([tf.keras.Input((1000,)), tf.keras.layers.Dense(10)])
opt = rhvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9),
                                compression={"method": "redsync", "density": 0.01})
model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rhvd.broadcast_variables(model.variables, root_rank=0)

data = tf.random.Generator.from_seed(1 + rhvd.rank())      # each rank its own samples
y = data.uniform((64 * 20,), 0, 10, dtype=tf.int64)        # class c: feature c is 1, plus noise
x = data.normal((64 * 20, 1000)) / 1000 ** 0.5 + tf.one_hot(y, 1000)


class PrintLoss(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if rhvd.rank() == 0:
            print(f"step {(epoch + 1) * 20} loss {logs['loss']:.4f}", flush=True)


model.fit(x, y, batch_size=64, epochs=5, verbose=0, shuffle=False, callbacks=[PrintLoss()])
if rhvd.rank() == 0:
    print("communication_stats:", json.dumps(model.optimizer.communication_stats(), default=str), flush=True)
