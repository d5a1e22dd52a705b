"""Zero-copy hand-over between TensorFlow and torch tensors through DLPack.

The algorithm core works on torch tensors; a TF gradient becomes a torch tensor that
shares its memory (``tf.experimental.dlpack.to_dlpack`` -> ``torch.utils.dlpack.from_dlpack``)
and the averaged torch result becomes a TF tensor the same way back. Nothing is copied
for float32 tensors on the same device. The core never writes into the tensors it is
handed (compressors must not modify their input, memory writes into its own buffers),
which matters because TF tensors are immutable.
"""
from __future__ import annotations

import tensorflow as tf
import torch
import torch.utils.dlpack as torch_dlpack


def to_torch(t: tf.Tensor) -> torch.Tensor:
    """Eager TF tensor -> torch tensor sharing the same memory."""
    return torch_dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(t))


# TensorFlow's kernels assume Eigen's alignment of every tensor's data (64 bytes on CPUs with
# AVX-512 builds) and abort the process on a tensor that lacks it (CheckTypeAndIsAligned)
TF_ALIGN_BYTES = 64


def to_tf(t: torch.Tensor) -> tf.Tensor:
    """torch tensor -> TF tensor sharing the same memory; copied first where it is not contiguous
    or not aligned as TF requires (a layer's view into one of the exchange's flat buffers)."""
    if not t.is_contiguous() or t.data_ptr() % TF_ALIGN_BYTES:
        t = t.clone(memory_format=torch.contiguous_format)   # a fresh, aligned allocation
    return tf.experimental.dlpack.from_dlpack(torch_dlpack.to_dlpack(t.detach()))


def torch_device(tf_device: str) -> torch.device:
    """'/job:localhost/replica:0/task:0/device:GPU:1' -> cuda:1; anything else -> cpu."""
    spec = tf.DeviceSpec.from_string(tf_device or "")
    if (spec.device_type or "").upper() == "GPU":
        return torch.device("cuda", spec.device_index or 0)
    return torch.device("cpu")
