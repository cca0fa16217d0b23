"""A real HTTP server on 127.0.0.1 that answers slowly, for the timing tests (timeouts and
deadlines act on sockets, so a transport-level fake would not show them)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.sdk.fakes import chunk, completion


class SlowServer:
    """Routes by the request path's first segment (the base URL is ``{url}/{scenario}/v1``):

    - ``/trickle/v1``: a chat stream of ``chunks`` events, one every ``interval`` seconds;
    - ``/stall/v1``: a stream that sends events for ``stall_after`` seconds, then nothing;
    - ``/late/v1``: a plain (non-stream) answer after ``delay`` seconds.
    """

    def __init__(self, interval: float = 0.2, chunks: int = 15, stall_after: float = 1.0,
                 delay: float = 5.0):
        self.interval, self.chunks, self.stall_after, self.delay = interval, chunks, stall_after, delay
        self.stop = threading.Event()  # ends every stall and sleep at teardown
        self.disconnects = 0  # streams whose client went away before the end
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends when the connection closes

            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                scenario = self.path.split("/")[1]
                try:
                    if scenario == "late":
                        server.stop.wait(server.delay)
                        self._send(200, "application/json", json.dumps(completion()).encode())
                    else:
                        self._stream(scenario)
                except (BrokenPipeError, ConnectionResetError):
                    server.disconnects += 1

            def _send(self, status, content_type, body=None):
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("x-request-id", "req-slow")
                self.end_headers()
                if body is not None:
                    self.wfile.write(body)

            def _stream(self, scenario):
                self._send(200, "text/event-stream")
                start = time.monotonic()
                for i in range(server.chunks):
                    if scenario == "stall" and time.monotonic() - start >= server.stall_after:
                        server.stop.wait(30)
                        return
                    self.wfile.write(b"data: " + json.dumps(chunk(f"t{i} ")).encode() + b"\n\n")
                    self.wfile.flush()
                    if server.stop.wait(server.interval):
                        return
                self.wfile.write(b"data: " + json.dumps(chunk(finish="stop")).encode() + b"\n\n"
                                 b"data: [DONE]\n\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def base_url(self, scenario: str) -> str:
        return f"{self.url}/{scenario}/v1"

    def __enter__(self) -> "SlowServer":
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
