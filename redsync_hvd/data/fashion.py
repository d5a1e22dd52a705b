"""Fashion-MNIST (Xiao, Rasul and Vollgraf, 2017): 28x28 grey images of clothes in 10 classes,
60,000 train and 10,000 test, in MNIST's four idx files (read by ``data/mnist.py``).

``data.path`` defaults to Debian's copy, ``/usr/share/datasets/fashion-mnist/`` (package
``dataset-fashion-mnist``, which ``scripts/install.sh`` installs when run as root); another
folder with the same four ``.gz`` (or plain) files works too. Images are scaled to [0, 1] and
normalised with Fashion-MNIST's own mean and std (``FASHION_MEAN``, ``FASHION_STD``), computed
once from the 60,000 training images (``tests/test_real_data.py`` recomputes them)::

    python -c "import gzip, numpy as np; x = np.frombuffer(gzip.open('/usr/share/datasets/fashion-mnist/\\
    train-images-idx3-ubyte.gz').read(), np.uint8, offset=16) / 255; print(x.mean(), x.std())"
    # 0.2860405969887955 0.35302424451492254
"""
from __future__ import annotations

from typing import Optional

from .base import DataBundle
from .mnist import idx_bundle

FASHION_MEAN, FASHION_STD = (0.2860,), (0.3530,)
DEFAULT_PATH = "/usr/share/datasets/fashion-mnist/"
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
           "Ankle boot")
_FIX = (f"as root, apt-get install dataset-fashion-mnist (Debian's copy, into {DEFAULT_PATH}; "
        "bash scripts/install.sh does it), or pass data.path=/folder/with/the/four/idx/files")


def build_fashion_mnist(path: Optional[str], rank: int, size: int, seed: int, *,
                        normalize: bool = True) -> DataBundle:
    """Fashion-MNIST bundle: this rank's shard of the 60k train images, all 10k test images;
    ``path`` None reads Debian's copy."""
    stats = (FASHION_MEAN, FASHION_STD) if normalize else None
    return idx_bundle("fashion_mnist", path or DEFAULT_PATH, rank, size, seed, stats, _FIX,
                      {"classes": list(CLASSES)})
