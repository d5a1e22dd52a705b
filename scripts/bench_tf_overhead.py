"""Per-step overhead of the TensorFlow adapter against plain horovod.tensorflow, dense fp32.

    horovodrun -np 2 -H localhost:2 .venv/bin/python scripts/bench_tf_overhead.py [--model cnn] [--steps 200]

In one process (both Horovod instances initialised), the same Keras model and batch are
trained with
  hvd_tf      horovod.tensorflow.DistributedGradientTape inside tf.function (the baseline)
  ours_fn     redsync_hvd.tensorflow.DistributedGradientTape inside tf.function, method none
              (the exchange runs in tf.py_function)
  ours_eager  gradients from a tf.function, the exchange called eagerly, the update in a tf.function
  local       no communication at all (what compute alone costs)
  torch_adapter  the same model in torch with redsync_hvd.torch.DistributedOptimizer, method none
  local_pyfunc_dlpack  local, plus the gradients through an identity tf.py_function and DLPack both
              ways (what the adapter adds around the core, without communication)
and, for information, ours_fn with topk/redsync at density 0.01. Variants run in interleaved
rounds (so a busy neighbour on shared cores hits them alike); the median step time of each
variant and its ratio to hvd_tf are printed by rank 0, plus the cost of the DLPack hand-over.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="cnn", help="cnn (digits CNN, 0.1M parameters) | mlp | mlp-wide "
                                                   "(digits MLP with 2 hidden layers of 1024: 1.2M parameters)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per variant (in rounds of --round)")
    ap.add_argument("--round", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the results here (rank 0)")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants to run")
    ap.add_argument("--no-tf-horovod", action="store_true",
                    help="initialise only horovod.torch's instance (no hvd_tf baseline): shows what the second "
                         "Horovod instance's background thread costs the other variants")
    args = ap.parse_args()

    import horovod.tensorflow as hvd_tf
    import tensorflow as tf
    import torch

    import redsync_hvd.tensorflow as rhvd
    import redsync_hvd.torch as rhvd_torch
    from redsync_hvd.tensorflow.dlpack import to_tf, to_torch
    from redsync_hvd.tensorflow.models import build_keras_model

    rhvd.init(tensorflow_horovod=not args.no_tf_horovod)   # horovod.torch (ours) + horovod.tensorflow (baseline)
    rank, size = rhvd.rank(), rhvd.size()
    n = max(1, (os.cpu_count() or 1) // rhvd.local_size())
    torch.set_num_threads(n)
    tf.config.threading.set_intra_op_parallelism_threads(n)

    name, options = {"cnn": ("cnn", {}), "mlp": ("mlp", {}), "mlp-wide": ("mlp", {"hidden": [1024, 1024]})}[args.model]
    model, named, shape = build_keras_model(name, 10, (1, 8, 8), seed=0, **options)
    variables = [v for _, v in named]
    rng = np.random.default_rng(rank)
    x = tf.constant(rng.random((args.batch,) + tuple(shape)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, args.batch))
    lossf = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    lr = 1e-3

    def apply(grads):
        for g, v in zip(grads, variables):
            v.assign_sub(lr * g)

    @tf.function
    def hvd_step():
        with tf.GradientTape() as tape:
            loss = lossf(y, model(x, training=True))
        tape = hvd_tf.DistributedGradientTape(tape)
        apply(tape.gradient(loss, variables))
        return loss

    def ours_fn(compression):
        ex = rhvd.TFGradientExchange(named, compression)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = lossf(y, model(x, training=True))
            tape = rhvd.DistributedGradientTape(tape, exchange=ex)
            apply(tape.gradient(loss, variables))
            return loss
        return step, ex

    @tf.function
    def grads_fn():
        with tf.GradientTape() as tape:
            loss = lossf(y, model(x, training=True))
        return tape.gradient(loss, variables)

    apply_fn = tf.function(apply)
    eager_ex = rhvd.TFGradientExchange(named, {"method": "none"})

    def ours_eager():
        apply_fn(eager_ex(grads_fn()))

    @tf.function
    def local_step():
        with tf.GradientTape() as tape:
            loss = lossf(y, model(x, training=True))
        apply(tape.gradient(loss, variables))
        return loss

    # the same model in torch with redsync_hvd.torch's optimizer, method none, for reference
    from redsync_hvd.models import build_model
    torch.manual_seed(0)
    tmodel = build_model(name, 10, (1, 8, 8), **options)
    topt = rhvd_torch.DistributedOptimizer(torch.optim.SGD(tmodel.parameters(), lr=lr),
                                           named_parameters=tmodel.named_parameters(), compression={"method": "none"})
    tx = torch.from_numpy(np.ascontiguousarray(x.numpy().transpose(0, 3, 1, 2)))
    ty = torch.from_numpy(y.numpy())

    def torch_step():
        topt.zero_grad()
        torch.nn.functional.cross_entropy(tmodel(tx), ty).backward()
        topt.step()

    variants = {
        "hvd_tf": hvd_step,
        "ours_fn": ours_fn({"method": "none"})[0],
        "ours_eager": ours_eager,
        "local": local_step,
        "ours_fn_topk": ours_fn({"method": "topk", "density": 0.01})[0],
        "ours_fn_redsync": ours_fn(
            {
                "method": "redsync",
                "density": 0.01,
                "dgc": {"momentum_correction": False},
                "policy": {"min_compress_numel": 1024},
            }
        )[0],
        "torch_adapter": torch_step,
    }
    # tf.py_function alone: the gradients go through an identity py_function, no communication
    @tf.function
    def pyfunc_step():
        with tf.GradientTape() as tape:
            loss = lossf(y, model(x, training=True))
        grads = tape.gradient(loss, variables)
        out = tf.py_function(lambda *g: [to_tf(to_torch(t)) for t in g], inp=grads, Tout=[g.dtype for g in grads])
        apply(out)
        return loss
    variants["local_pyfunc_dlpack"] = pyfunc_step
    if args.no_tf_horovod:
        del variants["hvd_tf"]
    if args.variants:
        keep = args.variants.split(",")
        variants = {k: v for k, v in variants.items() if k in keep}
    times = {k: [] for k in variants}
    for fn in variants.values():          # trace and warm up
        for _ in range(5):
            fn()
    rounds = max(1, args.steps // args.round)
    for _ in range(rounds):
        for key, fn in variants.items():
            rhvd.allreduce(tf.zeros([1]), name="bench.barrier")      # start each block together
            t0 = time.perf_counter()
            for _ in range(args.round):
                fn()      # tf.function calls return when the step is done
            times[key].append((time.perf_counter() - t0) / args.round)

    # the DLPack hand-over alone, both ways, for all gradients of one step
    g = grads_fn()
    t0 = time.perf_counter()
    for _ in range(200):
        [to_tf(to_torch(t)) for t in g]
    dlpack_ms = (time.perf_counter() - t0) / 200 * 1e3

    times = {k: v for k, v in times.items() if k in variants}
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    best = {k: min(v) * 1e3 for k, v in times.items()}
    base = med.get("hvd_tf", med.get("ours_fn", next(iter(med.values()))))
    result = {"model": args.model, "params": int(sum(v.shape.num_elements() for v in variables)),
              "tensors": len(variables), "workers": size, "batch": args.batch,
              "steps_per_variant": rounds * args.round, "median_step_ms": med,
              "best_round_step_ms": best,
              "baseline": "hvd_tf" if "hvd_tf" in med else "ours_fn" if "ours_fn" in med else next(iter(med)),
              "ratio_to_baseline": {k: v / base for k, v in med.items()},
              "overhead_ms_vs_baseline": {k: v - base for k, v in med.items()},
              "dlpack_roundtrip_ms_per_step": dlpack_ms}
    if rank == 0:
        print(f"model {args.model}: {result['params']} parameters in {len(variables)} tensors, "
              f"{size} workers, batch {args.batch}, {rounds * args.round} steps per variant")
        print(f"{'variant':<20}{'ms/step':>9}{'x ' + result['baseline']:>11}{'+ms':>9}{'best round':>12}")
        for k in med:
            print(f"{k:<20}{med[k]:>9.3f}{med[k] / base:>11.2f}{med[k] - base:>9.3f}{best[k]:>12.3f}")
        print(f"DLPack TF->torch->TF of all {len(variables)} gradients: {dlpack_ms:.3f} ms/step")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
