"""init(tensorflow_horovod=True) starts horovod.tensorflow's instance beside horovod.torch's:
both report the same rank and size, and horovod.tensorflow's own allreduce on a TF tensor gives
what our tape averages through horovod.torch (the mean of every rank's gradient, computed here
from the ranks' seeds).
"""
import numpy as np
import tensorflow as tf

import redsync_hvd.tensorflow as rhvd


def gradient_of(rank: int) -> np.ndarray:
    return np.random.default_rng(11 + rank).standard_normal((64, 32)).astype(np.float32)


def main():
    import horovod.tensorflow as hvd_tf

    assert not hvd_tf.is_initialized()
    rhvd.init(tensorflow_horovod=True)
    assert hvd_tf.is_initialized()
    rank, size = rhvd.rank(), rhvd.size()
    assert (hvd_tf.rank(), hvd_tf.size()) == (rank, size), ((hvd_tf.rank(), hvd_tf.size()), (rank, size))
    g = gradient_of(rank)
    expected = sum(gradient_of(r) for r in range(size)) / size

    v = tf.Variable(tf.zeros(g.shape))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * g)
    tape = rhvd.DistributedGradientTape(tape, compression={"method": "none"}, named_variables=[("w", v)])
    ours = tape.gradient(loss, [v])[0].numpy()
    theirs = hvd_tf.allreduce(tf.constant(g), op=hvd_tf.Average, name="two_instances.g").numpy()
    assert np.abs(ours - expected).max() < 1e-5, np.abs(ours - expected).max()
    assert np.abs(theirs - expected).max() < 1e-5, np.abs(theirs - expected).max()
    print(f"rank {rank}: OK two instances agree ({size} ranks)")


if __name__ == "__main__":
    main()
    from _tf_exit import exit_cleanly
    exit_cleanly()
