"""systemd's notify protocol (sd_notify(3)), spoken directly: datagrams to $NOTIFY_SOCKET.

Does nothing when the daemon was not started by systemd (no NOTIFY_SOCKET). A leading `@`
names a socket in the abstract namespace.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._socket = None
        self._warned = False
        if self._address:
            # Non-blocking: a receiver that stops reading must never stall the event loop.
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                                         | socket.SOCK_NONBLOCK)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def notify(self, **fields: str) -> bool:
        """Send `KEY=value` lines (e.g. READY="1", STATUS="..."); False if it could not."""
        if self._socket is None:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            self._socket.sendto(message, self._address)
        except BlockingIOError:
            return False  # the receiver's queue is full; STATUS is refreshed later anyway
        except OSError as exc:
            # Said once: a receiver that went away would otherwise be logged every sweep.
            if not self._warned:
                self._warned = True
                log.warning("sd_notify to %r failed: %s (not repeated)", self._address, exc)
            return False
        return True

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
