"""A deterministic asyncio event loop with virtual time, for running real daemons in the
simulator.

- Time is virtual: `loop.time()` reads a counter that the loop moves forward to the next timer
  when nothing is ready, so nothing ever sleeps and a run takes as long as its callbacks.
- Nothing runs on another thread: `run_in_executor` runs the function on the loop after a
  virtual delay the world chooses (a Raft log sync takes that long).
- Every callback runs on behalf of a node (the `environment.current` of the context it was
  scheduled in) or of the world: a crashed node's callbacks never run again, a paused node's
  wait until it is resumed (SIGSTOP and SIGCONT).
- Streams (`create_connection`, `create_server`) are the simulated network's
  (mooncaked/sim/streams.py); signals are ignored.

Same seed, same callbacks in the same order at the same virtual times: a run replays exactly.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import selectors

from mooncaked import environment


class Stalled(RuntimeError):
    """Nothing is ready and no timer is set: the run cannot go on."""


class _VirtualSelector(selectors.BaseSelector):
    """Never reports I/O (there is none); waiting for a timeout moves virtual time on."""

    def __init__(self, loop: "VirtualTimeLoop") -> None:
        self._loop = loop
        self._map: dict = {}

    def register(self, fileobj, events, data=None):
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int)
                                    else fileobj.fileno(), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj):
        return self._map.pop(fileobj)

    def select(self, timeout=None):
        if timeout is None:
            raise Stalled("no callback is ready and no timer is set")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def get_map(self):
        return self._map

    def close(self) -> None:
        self._map.clear()


def _drop(callback) -> None:
    """A crashed node's callback is never run; a task of its that never started has its
    coroutine closed (no code of it runs), as the process's death would have."""
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        coroutine = task.get_coro()
        if inspect.iscoroutine(coroutine) \
                and inspect.getcoroutinestate(coroutine) == inspect.CORO_CREATED:
            coroutine.close()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, network=None) -> None:
        self._now = 0.0
        super().__init__(_VirtualSelector(self))
        self.network = network  # the simulated network (streams.Network); set by the world
        # Chooses how long a run_in_executor call takes (virtual seconds); the world sets it.
        self.executor_delay = lambda: 0.0
        self.callbacks_run = 0

    # -- time -------------------------------------------------------------------------------

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    # -- callbacks on behalf of nodes ---------------------------------------------------------

    def _guard(self, callback, args, context):
        """The callback wrapped so that it runs only while its node is alive and not paused."""
        if context is None:
            context = contextvars.copy_context()
        env = context.get(environment.current)
        if getattr(env, "simulated", False) is False:
            return callback, args, context

        def guarded(*call_args):
            if env.crashed:
                _drop(callback)
                return
            if env.paused:
                env.held.append((callback, call_args, context))
                return
            self.callbacks_run += 1
            callback(*call_args)
        return guarded, args, context

    def call_soon(self, callback, *args, context=None):
        callback, args, context = self._guard(callback, args, context)
        return super().call_soon(callback, *args, context=context)

    def call_at(self, when, callback, *args, context=None):
        callback, args, context = self._guard(callback, args, context)
        return super().call_at(when, callback, *args, context=context)

    def resume(self, env) -> None:
        """A paused node goes on: what it was held from runs now, in order."""
        env.paused = False
        held, env.held = env.held, []
        for callback, args, context in held:
            super().call_soon(callback, *args, context=context)

    def call_soon_threadsafe(self, callback, *args, context=None):
        return self.call_soon(callback, *args, context=context)

    def run_in_executor(self, executor, func, *args):
        future = self.create_future()

        def run() -> None:
            if future.cancelled():
                return
            try:
                result = func(*args)
            except BaseException as error:  # noqa: BLE001 - handed to the awaiting code
                future.set_exception(error)
            else:
                future.set_result(result)
        self.call_later(self.executor_delay(), run)
        return future

    # -- the outside world --------------------------------------------------------------------

    def add_signal_handler(self, sig, callback, *args) -> None:
        pass

    def remove_signal_handler(self, sig) -> bool:
        return False

    async def create_connection(self, protocol_factory, host=None, port=None, **kwargs):
        return await self.network.connect(protocol_factory, host, port)

    async def create_server(self, protocol_factory, host=None, port=None, **kwargs):
        return self.network.listen(protocol_factory, host, port)

    async def create_unix_server(self, *args, **kwargs):
        raise NotImplementedError("the simulator has no Unix sockets")

    async def getaddrinfo(self, *args, **kwargs):
        raise NotImplementedError("the simulator resolves no names")
