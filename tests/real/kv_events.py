"""A subscriber to a real vLLM's KV-cache events, for tests: frames arrive as decoded dicts."""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

LISTENER = Path(__file__).with_name("kv_listen.py")
LIFETIME = 300.0  # seconds the listener lives at most, even if nobody stops it


class KvListener:
    """Bind ``endpoint`` (vLLM connects to it) and collect frames in the background.

    Each frame is ``{"parts", "topic", "seq", "seq_hex", "payload"}``; ``payload`` is vLLM's msgpack
    ``[timestamp, [event, ...], data_parallel_rank]`` with each event a dict tagged by ``"type"``."""

    def __init__(self, python: Path, endpoint: str, *, ready_timeout: float = 30.0) -> None:
        self.process = subprocess.Popen(
            [str(python), str(LISTENER), endpoint, str(LIFETIME)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        first = self._lines.get(timeout=ready_timeout)
        if first != "ready":
            self.close()
            raise RuntimeError(f"KV listener on {endpoint} did not start: {first!r} {self._stderr()}")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def _stderr(self) -> str:
        if self.process.stderr is None or self.process.poll() is None:
            return ""
        return self.process.stderr.read()[-2000:]

    def frames(self, *, wait: float) -> list[dict[str, Any]]:
        """Every frame received so far, waiting up to ``wait`` seconds for the first if none is there."""
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + wait
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()) if not got else 0.0)
            except queue.Empty:
                return got
            if line is None:
                return got
            got.append(json.loads(line))

    def close(self) -> None:
        """Closing its stdin tells the listener to exit; the reader sees EOF before the pipes close."""
        if self.process.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.process.stdin.close()
        try:
            self.process.wait(5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5.0)
        self._reader.join(5.0)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self) -> KvListener:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
