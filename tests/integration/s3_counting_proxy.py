"""A pass-through HTTP proxy in front of the real SeaweedFS S3 endpoint that counts the requests.

Clients talk to the proxy as if it were the endpoint; each request is forwarded unchanged (method,
path, headers including ``Host``, so SigV4 signatures still verify, body bytes as sent, chunked
framing included) and the answer is relayed back. ``requests`` lists (method, path) in arrival
order: how a test counts the PUTs a promotion really sent over the wire.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding"}


class CountingProxy:
    """``with CountingProxy(endpoint_url) as proxy: ... proxy.url ... proxy.requests``."""

    def __init__(self, endpoint_url: str) -> None:
        target = urlsplit(endpoint_url)
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    raw = bytearray()
                    while True:
                        line = self.rfile.readline()
                        raw += line
                        size = int(line.split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while True:  # trailers, then the blank line
                                trailer = self.rfile.readline()
                                raw += trailer
                                if trailer in (b"\r\n", b"\n", b""):
                                    return bytes(raw)
                        raw += self.rfile.read(size + 2)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self) -> None:
                body = self._body()
                with proxy._lock:
                    proxy.requests.append((self.command, self.path))
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        conn.putheader(name, value)
                    conn.endheaders()
                    if body:
                        conn.send(body)
                    answer = conn.getresponse()
                    data = answer.read()
                    self.send_response(answer.status, answer.reason)
                    head = self.command == "HEAD"  # its Content-Length is the object's size: relay it
                    for name, value in answer.getheaders():
                        if name.lower() not in _HOP and (head or name.lower() != "content-length"):
                            self.send_header(name, value)
                    if not head:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if not head:
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def count(self, method: str, contains: str = "") -> int:
        """Requests of ``method`` whose path contains ``contains``."""
        with self._lock:
            return sum(1 for m, p in self.requests if m == method and contains in p)
