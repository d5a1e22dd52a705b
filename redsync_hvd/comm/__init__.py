from .horovod import HorovodCommunicator
from .packing import pack, unpack_gathered

__all__ = ["HorovodCommunicator", "pack", "unpack_gathered"]
