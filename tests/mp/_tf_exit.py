"""Process exit for the TF test scripts.

A process that holds both TensorFlow and torch, each with its own Horovod instance
(``init(tensorflow_horovod=True)``), sometimes segfaults at exit after all of its work is done
(docs/tensorflow.md, "Known issue"). ``init()`` starts one instance, so only
tf_two_instances.py holds two. The scripts call ``exit_cleanly()`` only after their checks
passed: it shuts every started Horovod instance down, flushes the output and ends the process
without interpreter teardown. A failing check still raises (exit code 1).
"""
import os
import sys


def exit_cleanly() -> None:
    # shut both Horovod instances down first: the one that initialised MPI finalises it,
    # so mpirun sees a normal exit
    for mod in ("horovod.tensorflow", "horovod.torch"):
        if mod in sys.modules:
            sys.modules[mod].shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
