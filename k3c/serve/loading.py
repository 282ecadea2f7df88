"""Answers on the server's socket while the model loads: 503 to everything (`/health` says "loading").

    responder = LoadingResponder(sock).start()   # right after the socket is bound
    ...                                          # load the model (seconds to minutes)
    responder.stop()                             # before uvicorn takes the socket

Load balancers and orchestrators probe `/health` from the moment a process starts; without this a probe's
connection would wait in the listen backlog until the model had loaded (a timeout, not an answer). One thread
accepts, reads at most a request head (a second at most: a silent client cannot hold it), answers and closes.
"""
from __future__ import annotations

import json
import socket
import threading

_READ_S = 1.0
_HEALTH = json.dumps({"status": "loading"}).encode()
_ERROR = json.dumps({"error": {"message": "the model is still loading; retry shortly", "type": "server_error",
                               "param": None, "code": "unavailable"}}).encode()


class LoadingResponder:
    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="k3c-loading", daemon=True)
        self.answered = 0

    def start(self) -> LoadingResponder:
        self._sock.settimeout(0.1)              # the accept loop checks for stop() between waits
        self._thread.start()
        return self

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._sock.settimeout(None)             # back to blocking, as uvicorn expects a listening socket

    def _main(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(_READ_S)
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < 8192:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                head += chunk
        except OSError:
            pass
        line = head.split(b"\r\n", 1)[0].split()
        body = _HEALTH if len(line) >= 2 and line[1] == b"/health" else _ERROR
        try:
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Retry-After: 5\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode() +
                         b"\r\n\r\n" + body)
            self.answered += 1
        except OSError:
            pass
