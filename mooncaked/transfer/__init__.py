"""mooncaked's transfer layer: moving bytes between registered memory of this process and of
a remote segment. `mooncake_tcp` and `handshake` speak Mooncake Transfer Engine's own TCP
transport and handshake protocol, so real Mooncake processes interoperate with it."""

from .descriptors import BufferDescriptor, RegisteredMemory, SegmentDescriptor
from .endpoint import (READ, WRITE, SegmentError, TransferBatch, TransferEndpoint,
                       TransferRequest, TransferState, TransferStatus)

__all__ = ["BufferDescriptor", "RegisteredMemory", "SegmentDescriptor", "READ", "WRITE",
           "SegmentError", "TransferBatch", "TransferEndpoint", "TransferRequest",
           "TransferState", "TransferStatus"]
