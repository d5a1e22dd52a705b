from .horovod import HorovodCommunicator
from .local import LocalCommunicator
from .packing import pack, unpack_gathered

__all__ = ["HorovodCommunicator", "LocalCommunicator", "pack", "unpack_gathered"]
