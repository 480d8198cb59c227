"""Security tests run against the real lab: the web fixtures (alice, bob, PostgreSQL, the
test Redis, a real Celery worker) and, here, a listener on loopback that records what a
worker sends it.

The worker's environment is taken from this process when it starts, so the variables the
attacks aim at are set at import time, before any test starts it.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

# A server secret a hostile user would love to exfiltrate, and a key staff declared.
SERVER_SECRET_VAR = "RLLAB_TEST_SERVER_SECRET"
SERVER_SECRET = "server-secret-0a1b2c3d"
DECLARED_KEY_VAR = "RLLAB_TEST_ENDPOINT_KEY"
DECLARED_KEY = "declared-endpoint-key-42"
os.environ.setdefault(SERVER_SECRET_VAR, SERVER_SECRET)
os.environ.setdefault(DECLARED_KEY_VAR, DECLARED_KEY)


class Listener:
    """An OpenAI-compatible endpoint on 127.0.0.1 that answers every chat completion
    with `reply` and records each request's Authorization header."""

    def __init__(self, reply: str = "<move>4</move>"):
        self.authorizations: list[str] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                listener.authorizations.append(self.headers.get("Authorization", ""))
                length = int(self.headers.get("Content-Length") or 0)
                request = json.loads(self.rfile.read(length) or b"{}")
                body = json.dumps(
                    {
                        "id": "chatcmpl-test",
                        "object": "chat.completion",
                        "created": 0,
                        "model": request.get("model", "m"),
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": reply},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener():
    server = Listener()
    yield server
    server.close()
