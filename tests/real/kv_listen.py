"""Receive vLLM's KV-cache events and print each frame as one JSON line (run by the vLLM venv's python,
which has pyzmq and msgspec; the test venv has neither).

    python kv_listen.py tcp://127.0.0.1:PORT SECONDS

vLLM's ZMQ publisher *connects* to a non-wildcard endpoint, so this side binds. Prints ``ready`` once
bound, then one line per frame: ``{"parts": N, "topic": str, "seq": int, "seq_hex": str, "payload": ...}``
with the msgpack payload decoded (bytes shown as ``{"hex": ...}``). Exits after SECONDS or when stdin
closes, whichever comes first, so it can never outlive the test that started it.
"""

from __future__ import annotations

import json
import select
import sys
import time
from typing import Any

import msgspec
import zmq


def plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    return value


def main(argv: list[str]) -> int:
    endpoint, seconds = argv[1], float(argv[2])
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(endpoint)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    print("ready", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.readline():
            break  # the parent closed our stdin: it is done with us
        if not socket.poll(100):
            continue
        parts = socket.recv_multipart()
        frame: dict[str, Any] = {"parts": len(parts), "topic": parts[0].decode(errors="replace")}
        if len(parts) == 3:
            frame["seq_hex"] = parts[1].hex()
            frame["seq"] = int.from_bytes(parts[1], "big")
            frame["payload"] = plain(msgspec.msgpack.decode(parts[2]))
        print(json.dumps(frame), flush=True)
    socket.close()
    context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
