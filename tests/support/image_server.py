"""A local HTTP server of images for the image-URL tests, on a loopback address only (this
machine's tests never send traffic elsewhere). It runs in its own threads, so synchronous tests
against an `exo` process and async tests in the test's loop can both use it, and it counts the
requests each path gets: a refused URL must leave its count at 0.

Paths: /image.png (`image`), /text (text/plain), /big (`big_bytes` of image/png; with
?unsized=1 without a Content-Length, read till the server closes), /slow?s=SECONDS (an image,
late), /hops/N (N redirects, then the image), /to?url=URL (one redirect to URL),
/status?code=N, /together (answers only when two requests are in at once).
"""

from __future__ import annotations

import collections
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


class ImageServer:
    def __init__(self, image: bytes, host: str = "127.0.0.1", big_bytes: int = 1 << 20) -> None:
        assert host.startswith("127."), "loopback only"
        self.image, self.big_bytes = image, big_bytes
        self.hits: collections.Counter[str] = collections.Counter()
        self.together = threading.Barrier(2, timeout=5)
        self._server = ThreadingHTTPServer((host, 0), _handler_for(self))
        self._server.daemon_threads = True
        self._server.handle_error = lambda *_: None  # type: ignore[method-assign]  # a client that hung up early: expected
        self.url = f"http://{host}:{self._server.server_address[1]}"

    def __enter__(self) -> ImageServer:
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def total_hits(self) -> int:
        return sum(self.hits.values())


def _handler_for(server: ImageServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path, query = urlsplit(self.path).path, parse_qs(urlsplit(self.path).query)
            server.hits[path] += 1
            if path == "/image.png":
                self._send(200, "image/png", server.image)
            elif path == "/text":
                self._send(200, "text/plain", b"not an image")
            elif path == "/big":
                self._send(200, "image/png", b"\x89PNG" + bytes(server.big_bytes), sized="unsized" not in query)
            elif path == "/slow":
                time.sleep(float(query["s"][0]))
                self._send(200, "image/png", server.image)
            elif path.startswith("/hops/"):
                left = int(path.removeprefix("/hops/"))
                self._redirect(f"/hops/{left - 1}" if left > 1 else "/image.png")
            elif path == "/to":
                self._redirect(query["url"][0])
            elif path == "/status":
                self._send(int(query["code"][0]), "text/plain", b"")
            elif path == "/together":
                server.together.wait()  # a BrokenBarrierError (no second request in time) drops the connection
                self._send(200, "image/png", server.image)
            else:
                self._send(404, "text/plain", b"")

        def _redirect(self, location: str) -> None:
            self.send_response(302)
            self.send_header("Location", location)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _send(self, status: int, content_type: str, body: bytes, sized: bool = True) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            if sized:
                self.send_header("Content-Length", str(len(body)))
            else:
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

    return Handler
