"""What the emulated links really carry: TCP goodput and round-trip time between two hosts.

No iperf/ping needed: a tiny socket server runs in one host namespace and a client in
another (``python -m redsync_hvd.experiments.netbench.probe serve|client``); :func:`measure_link`
drives both and returns ``{"goodput_mbit", "rtt_ms", ...}``. Everything is bounded by
timeouts and uses only the addresses of our own namespaces.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

from ..jobs import REPO

CHUNK = 1 << 20


def _recv_exact(sock, n: int) -> None:
    left = n
    buf = bytearray(min(n, CHUNK) or 1)
    view = memoryview(buf)
    while left:
        got = sock.recv_into(view[:min(left, len(buf))])
        if not got:
            raise ConnectionError("peer closed early")
        left -= got


def serve(port: int, timeout: float) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    srv.settimeout(timeout)
    print("READY", flush=True)
    conn, _ = srv.accept()
    conn.settimeout(timeout)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn, srv:
        f = conn.makefile("rb")
        while True:
            line = f.readline()
            if not line:
                return
            cmd, n = line.split()
            n = int(n)
            if cmd == b"PING":
                for _ in range(n):
                    conn.sendall(f.read(1))
            elif cmd == b"BULK":
                left = n
                while left:  # through the buffered reader: it may hold the first bytes
                    chunk = f.read1(min(left, CHUNK))
                    if not chunk:
                        raise ConnectionError("peer closed early")
                    left -= len(chunk)
                conn.sendall(b"K")
            else:
                return


def client(host: str, port: int, nbytes: int, pings: int, timeout: float) -> dict:
    deadline = time.time() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with sock:
        rtts = []
        sock.sendall(f"PING {pings}\n".encode())
        for _ in range(pings):
            t0 = time.perf_counter()
            sock.sendall(b"x")
            _recv_exact(sock, 1)
            rtts.append(time.perf_counter() - t0)
        payload = b"\0" * CHUNK
        sock.sendall(f"BULK {nbytes}\n".encode())
        t0 = time.perf_counter()
        left = nbytes
        while left:
            n = min(left, CHUNK)
            sock.sendall(payload[:n])
            left -= n
        _recv_exact(sock, 1)
        dt = time.perf_counter() - t0
        sock.sendall(b"QUIT 0\n")
    rtt = statistics.median(rtts[1:] or rtts)
    # the final ack costs half an RTT on top of the transfer
    return {"bytes": nbytes, "seconds": dt, "goodput_mbit": nbytes * 8 / max(dt - rtt / 2, 1e-9) / 1e6,
            "rtt_ms": rtt * 1e3, "rtt_min_ms": min(rtts) * 1e3}


def measure_link(net, src: int = 0, dst: int = 1, nbytes: int = 64 << 20, pings: int = 50,
                 port: int = 5299, timeout: float = 60.0) -> dict:
    """TCP goodput src -> dst and RTT, through the shaped links of ``net`` (a ShapedNetwork)."""
    py = sys.executable
    srv = subprocess.Popen(net.exec_prefix(dst) + [py, "-m", __name__, "serve", "--port", str(port),
                                                   "--timeout", str(timeout)],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        if srv.stdout.readline().strip() != "READY":
            raise RuntimeError(f"probe server failed: {srv.stderr.read()[-2000:]}")
        out = subprocess.run(net.exec_prefix(src) + [py, "-m", __name__, "client",
                                                     "--host", net.host_addr(dst), "--port", str(port),
                                                     "--bytes", str(nbytes), "--pings", str(pings),
                                                     "--timeout", str(timeout)],
                             cwd=REPO, capture_output=True, text=True, timeout=timeout + 10)
        if out.returncode != 0:
            raise RuntimeError(f"probe client failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait(timeout=10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("mode", choices=["serve", "client"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=5299)
    ap.add_argument("--bytes", type=int, default=64 << 20)
    ap.add_argument("--pings", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args(argv)
    if a.mode == "serve":
        serve(a.port, a.timeout)
    else:
        print(json.dumps(client(a.host, a.port, a.bytes, a.pings, a.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
