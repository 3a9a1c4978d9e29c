"""The receive buffer of a framed stream (client connections and peer links).

Headers and small frames arrive in a scratch buffer; `_start:_end` is what is not yet consumed.
It grows for one large header (bounded by the frame check) and shrinks back once that is
consumed. Payloads nobody wants are received into a throw-away buffer. A mixin: the attributes
stay on the protocol object, so the receive path reads them directly.
"""

from __future__ import annotations


class ScratchBuffer:
    scratch_bytes = 64 * 1024
    discard_bytes = 64 * 1024

    def _init_scratch(self) -> None:
        self._scratch = bytearray(self.scratch_bytes)
        self._scratch_view = memoryview(self._scratch)
        self._start = 0  # unconsumed bytes are scratch[_start:_end]
        self._end = 0
        self._discard: memoryview | None = None

    def _reset_if_consumed(self) -> None:
        """Between frames with nothing unconsumed: start over, and drop a grown buffer."""
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._scratch) > self.scratch_bytes:
                self._scratch = bytearray(self.scratch_bytes)
                self._scratch_view = memoryview(self._scratch)

    def _compact(self) -> None:
        unconsumed = self._end - self._start
        if self._start:
            self._scratch[:unconsumed] = self._scratch[self._start:self._end]
            self._start, self._end = 0, unconsumed

    def _grow(self, size: int) -> None:
        """Make the scratch buffer hold a header of `size` bytes.

        A new buffer, not a resize: the loop may still hold a view of the old one.
        """
        unconsumed = self._end - self._start
        bigger = bytearray(size)
        bigger[:unconsumed] = self._scratch_view[self._start:self._end]
        self._scratch = bigger
        self._scratch_view = memoryview(bigger)
        self._start, self._end = 0, unconsumed

    def _discard_view(self) -> memoryview:
        if self._discard is None:
            self._discard = memoryview(bytearray(self.discard_bytes))
        return self._discard
