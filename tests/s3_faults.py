"""A real HTTP proxy in front of the test S3 server that refuses chosen requests, as a bucket policy
or a failing network would: the client (s3fs/botocore) sees a real ``403 AccessDenied`` over the
wire, and everything else reaches moto unchanged.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied (refused by the test proxy)</Message></Error>"
)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


@contextmanager
def refusing_proxy(endpoint: str, refuse: Callable[[str, str], bool]) -> Iterator[tuple[str, list[str]]]:
    """Yield ``(proxy endpoint URL, refused)``: requests for which ``refuse(method, path)`` is true
    get 403 AccessDenied (and are listed in ``refused`` as ``"METHOD path"``); the rest go to
    ``endpoint``."""
    upstream = urllib.parse.urlsplit(endpoint)
    refused: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            """Quiet: the test log is not the place for every request."""

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if refuse(self.command, urllib.parse.urlsplit(self.path).path):
                refused.append(f"{self.command} {self.path}")
                self.send_response(403)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(_DENIED)))
                self.end_headers()
                self.wfile.write(_DENIED)
                return
            connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP | {"expect"}}
                connection.request(self.command, self.path, body=body, headers=headers)
                response = connection.getresponse()
                data = response.read()
                self.send_response(response.status, response.reason)
                chunked = False
                for key, value in response.getheaders():
                    if key.lower() == "transfer-encoding":
                        chunked = True
                    elif key.lower() not in _HOP_BY_HOP:
                        self.send_header(key, value)
                if chunked:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
            finally:
                connection.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", refused
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
