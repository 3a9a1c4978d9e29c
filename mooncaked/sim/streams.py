"""Simulated stream connections between the simulator's nodes and clients.

A connection is two directions, each a queue of deliveries (bytes, then end-of-stream or a
reset) in order, each delivered after a delay drawn from the seed's generator, never before the
one ahead of it (a stream keeps its order). The network knows which endpoint (node name, or a
client's) each side belongs to:
- a partition between two endpoints holds what is sent across it until it heals, or, in
  `reset` mode, resets the connection at once;
- connecting to an address nobody listens on (a crashed node) is refused;
- connecting across a partition fails after a connect delay, as a lost SYN times out;
- a crash aborts every connection of the crashed endpoint: the other side sees a reset.

Transports drive both `asyncio.Protocol` (data_received) and `asyncio.BufferedProtocol`
(get_buffer / buffer_updated) the way the selector loop does. A transport copies what it is
given at write() (the caller may reuse its buffer, as a socket's would be copied).
"""

from __future__ import annotations

import asyncio
import contextvars
import random

from mooncaked import environment

MAX_READ_BYTES = 256 * 1024  # what one delivery hands a BufferedProtocol at most
ORDER_GAP_S = 1e-6  # between two deliveries of one direction at least


class _FakeSocket:
    """What callers look up on a server's sockets: its address; options are ignored."""

    def __init__(self, address) -> None:
        self._address = address

    def getsockname(self):
        return self._address

    def setsockopt(self, *args) -> None:
        pass


class Server:
    """A listening address; `close()` stops accepting (open connections stay)."""

    def __init__(self, network: "Network", owner: str, address, factory,
                 context: contextvars.Context) -> None:
        self.network = network
        self.owner = owner
        self.address = address
        self.factory = factory
        self.context = context
        self.sockets = [_FakeSocket(address)]
        self.serving = True

    def close(self) -> None:
        if self.serving:
            self.serving = False
            if self.network.listeners.get(self.address) is self:
                del self.network.listeners[self.address]

    async def wait_closed(self) -> None:
        pass

    def is_serving(self) -> bool:
        return self.serving

    def get_loop(self):
        return self.network.loop


class _Direction:
    """One direction of a connection: deliveries in order."""

    __slots__ = ("last_at", "held")

    def __init__(self) -> None:
        self.last_at = 0.0  # virtual time the last delivery was scheduled for
        self.held: list = []  # deliveries held by a partition, in order


class Transport(asyncio.Transport):
    def __init__(self, network: "Network", owner: str, local, remote,
                 context: contextvars.Context) -> None:
        super().__init__()
        self.network = network
        self.owner = owner  # the endpoint this side belongs to
        self.local = local
        self.remote = remote
        self.context = context  # the owner's: its protocol's callbacks run in it
        self.protocol = None
        self.peer: Transport | None = None
        self.outgoing = _Direction()
        network.serial += 1
        self.serial = network.serial  # orders transports the same way on every run
        self._closing = False
        self._lost = False
        self._reading_paused = False
        self._inbox: list = []  # delivered while reading was paused
        self._eof_received = False

    # -- asyncio.Transport --------------------------------------------------------------------

    def get_extra_info(self, name, default=None):
        return {"peername": self.remote, "sockname": self.local}.get(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def set_protocol(self, protocol) -> None:
        self.protocol = protocol

    def get_protocol(self):
        return self.protocol

    def is_reading(self) -> bool:
        return not self._reading_paused and not self._closing

    def pause_reading(self) -> None:
        self._reading_paused = True

    def resume_reading(self) -> None:
        if not self._reading_paused:
            return
        self._reading_paused = False
        if self._inbox:
            inbox, self._inbox = self._inbox, []
            for item in inbox:
                self.network.loop.call_soon(self._receive, item, context=self.context)

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self):
        return (0, 0)

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def write(self, data) -> None:
        if self._closing or not data:
            return
        self.network.bytes_sent += len(data)
        self._send(("data", bytes(data)))

    def writelines(self, chunks) -> None:
        self.write(b"".join(bytes(c) for c in chunks))

    def write_eof(self) -> None:
        self._send(("eof", None))

    def can_write_eof(self) -> bool:
        return True

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._send(("eof", None))
        self._lose(None)

    def abort(self) -> None:
        if self._lost:
            return
        self._closing = True
        self._send(("reset", None))
        self._lose(None)

    # -- the simulation -------------------------------------------------------------------------

    def _send(self, item) -> None:
        if self.peer is not None:
            self.network.schedule(self, self.peer, item)

    def _lose(self, exc) -> None:
        """connection_lost, once, soon, in the owner's context."""
        if self._lost:
            return
        self._lost = True
        self._closing = True
        self.network.transports.discard(self)
        protocol = self.protocol
        if protocol is not None:
            self.network.loop.call_soon(protocol.connection_lost, exc, context=self.context)

    def _receive(self, item) -> None:
        """A delivery reaches this side (in its owner's context)."""
        if self._lost:
            return
        kind, data = item
        if kind == "reset":
            self._inbox.clear()
            self._lose(ConnectionResetError("connection reset by peer"))
            return
        if self._reading_paused:
            self._inbox.append(item)
            return
        if kind == "eof":
            keep_open = False
            eof_received = getattr(self.protocol, "eof_received", None)
            if eof_received is not None and not self._eof_received:
                self._eof_received = True
                keep_open = eof_received()
            if not keep_open:
                self.close()
            return
        protocol = self.protocol
        if isinstance(protocol, asyncio.BufferedProtocol):
            view = memoryview(data)
            while view and not self._lost:
                buffer = protocol.get_buffer(min(len(view), MAX_READ_BYTES))
                count = min(len(buffer), len(view))
                if count == 0:
                    raise RuntimeError("get_buffer() returned an empty buffer")
                buffer[:count] = view[:count]
                protocol.buffer_updated(count)
                view = view[count:]
                if self._reading_paused and view:
                    # The rest waits for resume_reading, as a socket's would in the kernel.
                    self._inbox.append(("data", bytes(view)))
                    return
        else:
            protocol.data_received(data)

    def reset(self) -> None:
        """The network broke the connection (a partition in reset mode): this side sees a
        reset, as the other side does."""
        self._inbox.clear()
        self._lose(ConnectionResetError("connection reset (network partition)"))

    def crash(self) -> None:
        """The owner died: the other side sees a reset; this side's protocol hears nothing."""
        if self._lost:
            return
        self._send(("reset", None))
        self._lost = True
        self._closing = True
        self.network.transports.discard(self)


class Network:
    def __init__(self, loop, rng: random.Random, *, min_delay_s: float = 0.0002,
                 max_delay_s: float = 0.003, trace=None) -> None:
        self.loop = loop
        loop.network = self
        self.rng = rng
        self.min_delay_s = min_delay_s
        self.max_delay_s = max_delay_s
        self.slow_s = 0.0  # added to every delay while the seed's schedule says so
        self.listeners: dict = {}  # (host, port) -> Server
        self.transports: set[Transport] = set()
        self.cut: set[frozenset] = set()  # pairs of endpoints that cannot reach each other
        self.reset_on_partition = False
        self.bytes_sent = 0
        self.connections_made = 0
        self._next_port = 40000
        self.serial = 0
        self.holding: set[Transport] = set()  # transports with deliveries held by a partition
        self._kernel = contextvars.Context()  # the hosts' kernels: never crash or pause
        self.trace = trace or (lambda text: None)

    # -- endpoints ------------------------------------------------------------------------------

    @staticmethod
    def owner_of(context: contextvars.Context | None = None) -> str:
        env = (context.get(environment.current) if context is not None
               else environment.current.get())
        return getattr(env, "name", "world")

    def listen(self, factory, host, port) -> Server:
        owner = self.owner_of()
        if not port:
            self._next_port += 1
            port = self._next_port
        address = (host or "127.0.0.1", int(port))
        existing = self.listeners.get(address)
        if existing is not None:
            raise OSError(98, f"address {address} already in use by {existing.owner}")
        server = Server(self, owner, address, factory, contextvars.copy_context())
        self.listeners[address] = server
        return server

    async def connect(self, factory, host, port):
        loop = self.loop
        owner = self.owner_of()
        context = contextvars.copy_context()
        address = (host, int(port))
        await asyncio.sleep(self._delay())
        server = self.listeners.get(address)
        if server is not None and self.partitioned(owner, server.owner):
            await asyncio.sleep(1.0)  # the SYN is lost: the connect times out
            raise TimeoutError(f"connecting to {host}:{port} timed out")
        if server is None or not server.serving:
            raise ConnectionRefusedError(111, f"Connect call failed ({host!r}, {port})")
        self._next_port += 1
        local = ("127.0.0.1", self._next_port)
        client = Transport(self, owner, local, address, context)
        accepted = Transport(self, server.owner, address, local, server.context)
        client.peer, accepted.peer = accepted, client
        self.transports.add(client)
        self.transports.add(accepted)
        self.connections_made += 1

        def accept() -> None:
            if accepted._lost:
                return
            protocol = server.factory()
            accepted.protocol = protocol
            protocol.connection_made(accepted)
        # Accepted on the server's side before anything the client sends reaches it.
        loop.call_soon(accept, context=server.context)
        protocol = factory()
        client.protocol = protocol
        protocol.connection_made(client)
        return client, protocol

    # -- delivery ---------------------------------------------------------------------------------

    def _delay(self) -> float:
        return self.rng.uniform(self.min_delay_s, self.max_delay_s) + self.slow_s

    def partitioned(self, a: str, b: str) -> bool:
        return a != b and frozenset((a, b)) in self.cut

    def schedule(self, sender: Transport, receiver: Transport, item) -> None:
        direction = sender.outgoing
        if self.partitioned(sender.owner, receiver.owner):
            if self.reset_on_partition:
                sender.reset()
                receiver.reset()
                return
            direction.held.append(item)
            self.holding.add(sender)
            return
        # Strictly after the one ahead: the loop's timer heap does not keep equal times in
        # the order they were set.
        at = max(self.loop.time() + self._delay(), direction.last_at + ORDER_GAP_S)
        direction.last_at = at
        self.loop.call_at(at, self._arrive, sender, receiver, item, context=self._kernel)

    def _arrive(self, sender: Transport, receiver: Transport, item) -> None:
        """What the receiving host's kernel does with a delivery: hand it to the process
        (whose callbacks wait while it is paused), or, for a connection the process no longer
        has (crashed or closed), answer data with a reset."""
        if receiver._lost:
            if item[0] == "data" and not sender._lost:
                self.schedule(receiver, sender, ("reset", None))
            return
        self.loop.call_soon(receiver._receive, item, context=receiver.context)

    def partition(self, group_a: set[str], group_b: set[str]) -> None:
        for a in group_a:
            for b in group_b:
                if a != b:
                    self.cut.add(frozenset((a, b)))
        if self.reset_on_partition:
            for transport in sorted(self.transports, key=lambda t: t.serial):
                peer = transport.peer
                if peer is not None and self.partitioned(transport.owner, peer.owner):
                    transport.reset()

    def heal(self) -> None:
        """Every partition ends; what was held is delivered, in order."""
        self.cut.clear()
        holding, self.holding = self.holding, set()
        for transport in sorted(holding, key=lambda t: t.serial):
            direction = transport.outgoing
            held, direction.held = direction.held, []
            for item in held:
                if transport.peer is not None:
                    self.schedule(transport, transport.peer, item)

    def crash(self, owner: str) -> None:
        """An endpoint dies: its listeners go, its connections are reset."""
        for address, server in list(self.listeners.items()):
            if server.owner == owner:
                server.serving = False
                del self.listeners[address]
        for transport in sorted(self.transports, key=lambda t: t.serial):
            if transport.owner == owner:
                transport.crash()
