"""A raw-socket page server: the transport limit that the Redis benchmark is measured against.

What is left of a remote page read once Redis is taken away: one TCP round trip
on loopback, a numpy gather on the server and the bytes on the wire. A measuring
stick, not a product: no auth, no timeouts, one thread per connection.

Protocol, per request on one TCP connection:
    client -> server   u32 n, then n u32 page indices (all little-endian)
    server -> client   n * 4096 bytes: the pages in request order (one sendall)
An index out of range closes the connection.

The server is a separate process (multiprocessing, spawn) so its gather and
socket work do not share the client's GIL; the pages reach it through shared
memory, copied once.

Worked example: pages [100_000, 4096]; request (n=2, [7, 3]) is 12 bytes
b"\\x02\\0\\0\\0\\x07\\0\\0\\0\\x03\\0\\0\\0"; the reply is 8192 bytes, pages 7 then 3.

    .venv/bin/python benchmarks/raw_page_server.py   # self-check: 700 and 3,000 of 100k pages, median of 50
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import threading
import time
from multiprocessing import shared_memory

import numpy as np

PAGE_BYTES = 4096
HOST = "127.0.0.1"


def _recv_exact(sock: socket.socket, out: memoryview) -> bool:
    """Fill `out` from `sock`; False if the peer closed first."""
    got = 0
    while got < len(out):
        n = sock.recv_into(out[got:])
        if n == 0:
            return False
        got += n
    return True


def _handle(conn: socket.socket, pages: np.ndarray) -> None:
    """Serve one connection until the client closes it (pages: [P, 4096] uint8)."""
    head = np.empty(1, "<u4")
    indices = np.empty(0, "<u4")
    gathered = np.empty((0, PAGE_BYTES), np.uint8)
    with conn:
        while _recv_exact(conn, memoryview(head).cast("B")):
            n = int(head[0])
            if n > len(indices):  # buffers grow to the largest request seen, then are reused
                indices, gathered = np.empty(n, "<u4"), np.empty((n, PAGE_BYTES), np.uint8)
            if not _recv_exact(conn, memoryview(indices[:n]).cast("B")):
                return
            if n and int(indices[:n].max()) >= len(pages):
                return
            np.take(pages, indices[:n], axis=0, out=gathered[:n])  # gathered[:n]: [n, 4096] uint8
            conn.sendall(memoryview(gathered[:n]).cast("B"))


def _serve(shm_name: str, n_pages: int, port_out: mp.connection.Connection) -> None:
    """The server process: attach the shared pages, listen on a free loopback port, report it, serve forever."""
    shm = shared_memory.SharedMemory(name=shm_name)
    pages = np.ndarray((n_pages, PAGE_BYTES), np.uint8, buffer=shm.buf)
    listener = socket.create_server((HOST, 0))
    port_out.send(listener.getsockname()[1])
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_handle, args=(conn, pages), daemon=True).start()


class RawPageServer:
    """`pages` [P, 4096] uint8 served from a child process on loopback; `start()` / `stop()` or `with`."""

    def __init__(self, pages: np.ndarray) -> None:
        if pages.ndim != 2 or pages.shape[1] != PAGE_BYTES or pages.dtype != np.uint8:
            raise ValueError(f"pages must be [P, {PAGE_BYTES}] uint8, got {pages.shape} {pages.dtype}")
        self._pages = pages
        self.host, self.port = HOST, 0
        self._shm: shared_memory.SharedMemory | None = None
        self._proc: mp.process.BaseProcess | None = None

    def start(self) -> RawPageServer:
        """Copy the pages to shared memory, start the server process and wait for its port."""
        self._shm = shared_memory.SharedMemory(create=True, size=max(1, self._pages.nbytes))
        np.ndarray(self._pages.shape, np.uint8, buffer=self._shm.buf)[:] = self._pages
        ctx = mp.get_context("spawn")
        port_in, port_out = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_serve, args=(self._shm.name, len(self._pages), port_out), daemon=True)
        self._proc.start()
        if not port_in.poll(30):
            self.stop()
            raise RuntimeError("raw page server did not report its port within 30 s")
        self.port = port_in.recv()
        return self

    def stop(self) -> None:
        """End the server process and free the shared memory (safe to call twice)."""
        if self._proc is not None:
            self._proc.terminate()
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
            self._proc = None
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None

    def __enter__(self) -> RawPageServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RawPageClient:
    """One connection to a `RawPageServer`; `read` is one request and its whole reply."""

    def __init__(self, host: str, port: int) -> None:
        self._sock = socket.create_connection((host, port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._request = np.empty(1, "<u4")

    def read(self, indices: np.ndarray, out: np.ndarray) -> None:
        """Pages `indices` ([n] ints) into `out[:n]` ([>= n, 4096] uint8, C-contiguous, preallocated)."""
        n = len(indices)
        if len(self._request) < n + 1:
            self._request = np.empty(n + 1, "<u4")
        self._request[0] = n
        self._request[1:n + 1] = indices
        self._sock.sendall(memoryview(self._request[:n + 1]).cast("B"))
        if not _recv_exact(self._sock, memoryview(out[:n]).cast("B")):
            raise ConnectionError("raw page server closed the connection (an index out of range?)")

    def close(self) -> None:
        self._sock.close()


def _self_check(n_pages: int = 100_000, sizes: tuple[int, ...] = (700, 3000), repeats: int = 50) -> None:
    """Time random reads of `sizes` pages out of `n_pages` (median of `repeats`) and check every page."""
    pages = np.zeros((n_pages, PAGE_BYTES), np.uint8)
    pages.view(np.uint64)[:, 0] = np.arange(n_pages)  # page p starts with p: the check is one compare
    rng = np.random.default_rng(0)
    print(f"raw page server, loopback, {n_pages:,} pages of {PAGE_BYTES} B, median of {repeats}")
    print(f"{'pages':>6} {'median ms':>10} {'p90 ms':>8} {'GB/s':>6} {'us/page':>8}")
    with RawPageServer(pages) as server:
        client = RawPageClient(server.host, server.port)
        for n in sizes:
            out = np.empty((n, PAGE_BYTES), np.uint8)
            times = []
            for _ in range(repeats + 3):  # 3 warm-up reads
                indices = rng.integers(0, n_pages, n, dtype=np.uint32)
                began = time.perf_counter()
                client.read(indices, out)
                times.append(time.perf_counter() - began)
                assert np.array_equal(out.view(np.uint64)[:, 0], indices), "wrong pages"
            times = sorted(times[3:])
            median = statistics.median(times)
            print(f"{n:>6} {median * 1e3:>10.2f} {times[int(0.9 * len(times))] * 1e3:>8.2f} "
                  f"{n * PAGE_BYTES / median / 1e9:>6.2f} {median / n * 1e6:>8.2f}")
        client.close()


if __name__ == "__main__":
    _self_check()
