"""A compression spec for the DDP scripts: the dict itself where the registry knows the method,
else (baselines not registered yet) the compressor built from the method's own config class."""
from redsync_hvd.compressors import COMPRESSORS


def compression_arg(spec: dict):
    if spec["method"] in COMPRESSORS:
        return spec
    from redsync_hvd.compressors import powersgd, qsgd, signsgd
    classes = {"powersgd": (powersgd.PowerSGDCompressor, powersgd.PowerSGDConfig),
               "signsgd": (signsgd.SignSGDCompressor, signsgd.SignSGDConfig),
               "qsgd": (qsgd.QSGDCompressor, qsgd.QSGDConfig)}
    compressor, config = classes[spec["method"]]
    return compressor(config(**spec))
