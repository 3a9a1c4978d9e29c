"""What the fuzz targets stand in for: an asyncio transport that records what the daemon
writes, and a log handler that keeps the daemon's error records (each one is a finding)."""

from __future__ import annotations

import logging


class FakeTransport:
    """What Connection uses of an asyncio transport; records what is written."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.closing = False
        self.paused = False
        self.writes_after_close = 0

    def write(self, data) -> None:
        if self.closing:
            self.writes_after_close += 1
        self.written += data

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0  # the fuzzer's client takes every byte at once

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name, default=None):
        return default


class ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
