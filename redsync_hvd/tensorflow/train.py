"""``python -m redsync_hvd.tensorflow.train --config <framework: tensorflow config>``: the YAML
runner (``python -m redsync_hvd.train``), refusing configs of another framework."""
from __future__ import annotations

from ..train import exit_with
from ..train import main as _main


def main(argv=None) -> int:
    return _main(argv, framework="tensorflow")


if __name__ == "__main__":
    exit_with(main())
