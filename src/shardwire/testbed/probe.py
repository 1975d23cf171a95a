"""One timed TCP transfer, for measuring a testbed's links: run ``receive`` on one node and ``send``
on another (or the same) node.

    python probe.py receive --bind 10.77.0.2            # prints "ready PORT", then the result
    python probe.py send --to 10.77.0.2 --port PORT --bytes 125000000

The receiver times from the first data to the end of the stream, so connection setup is not
counted, and prints ``{"bytes": ..., "seconds": ...}`` as JSON. It imports only the standard
library and is run as a script, so that it starts at once.
"""

from __future__ import annotations

import argparse
import json
import socket
import time

CHUNK = 1 << 20


def receive(bind: str, timeout_s: float) -> dict:
    with socket.create_server((bind, 0)) as server:  # a free port, announced
        server.settimeout(timeout_s)
        print("ready", server.getsockname()[1], flush=True)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(timeout_s)
        buffer = bytearray(CHUNK)
        conn.recv_into(buffer)  # the clock starts once data flows; what came with it is not counted
        start, received = time.perf_counter(), 0
        while chunk := conn.recv_into(buffer):
            received += chunk
        return {"bytes": received, "seconds": time.perf_counter() - start}


def send(to: str, port: int, nbytes: int, timeout_s: float) -> None:
    payload = bytes(CHUNK)
    with socket.create_connection((to, port), timeout=timeout_s) as conn:
        for offset in range(0, nbytes, CHUNK):
            conn.sendall(payload[: min(CHUNK, nbytes - offset)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=["receive", "send"])
    parser.add_argument("--bind", help="receive: the address to listen on")
    parser.add_argument("--to", help="send: the receiver's address")
    parser.add_argument("--port", type=int, help="send: the port the receiver announced")
    parser.add_argument("--bytes", type=int, default=0, help="send: how many bytes")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before giving up")
    args = parser.parse_args()
    if args.role == "receive":
        print(json.dumps(receive(args.bind, args.timeout)), flush=True)
    else:
        send(args.to, args.port, args.bytes, args.timeout)


if __name__ == "__main__":
    main()
