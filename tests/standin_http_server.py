"""A stand-in for a rollout server's HTTP side, for tests of who starts, watches and restarts
servers: every GET answers 200 with the server's pid and parent pid, so a test can tell a
restarted server from the old one and see which process started it.

Usage: python standin_http_server.py HOST PORT [FAIL_FLAG]; with FAIL_FLAG an existing file, the
server exits 3 at start (a node that cannot start its server). With STANDIN_REQUEST_LOG set, every
request line it reads (any method; only GET is answered 200) is appended to that file: what reached
the server, counted even for a request whose client gave up while the server was stopped."""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

if len(sys.argv) > 3 and os.path.exists(sys.argv[3]):
    sys.exit(3)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def parse_request(self):
        ok = super().parse_request()
        if os.environ.get("STANDIN_REQUEST_LOG"):
            with open(os.environ["STANDIN_REQUEST_LOG"], "a") as f:
                f.write(self.requestline + "\n")
        return ok

    def do_GET(self):
        body = json.dumps({"pid": os.getpid(), "ppid": os.getppid()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    HTTPServer((sys.argv[1], int(sys.argv[2])), Handler).serve_forever()
