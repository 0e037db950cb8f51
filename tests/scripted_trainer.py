"""A scripted OpenAI-compatible model server on loopback: it plays the trainer's
inference engine in the rollout tests and benchmark.

Deterministic answers (the text says which prompt it answers), token ids and logprobs
in every choice (what an RL trainer reads), ``stream: true`` as SSE chunks. Every call
it received is kept (``calls``), so a test can prove none reached it twice. ``stop()``
closes the listening socket (a preempted trainer: connections are refused).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # a hundred rollouts calling at once after an outage


class ScriptedTrainer:
    def __init__(
        self,
        *,
        delay: float = 0.0,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        hold_after_first: bool = False,
    ) -> None:
        self.delay = delay
        self.host = host
        # Answer only each rollout's "step 0"; hold the other calls until stop(), which
        # drops them unanswered (a trainer preempted with calls in flight).
        self.hold_after_first = hold_after_first
        self.answered: list[str] = []
        self._dead = threading.Event()
        self.api_key = api_key
        self.calls: list[dict[str, Any]] = []
        self.auth_seen: list[str] = []
        self._mu = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ScriptedTrainer:
        trainer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection: a kill is clean

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._json(200, {"object": "list", "data": [{"id": "scripted"}]})

            def do_POST(self) -> None:
                size = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(size) or b"{}")
                auth = self.headers.get("authorization", "")
                with trainer._mu:
                    trainer.calls.append(body)
                    trainer.auth_seen.append(auth)
                if trainer.api_key is not None and auth != f"Bearer {trainer.api_key}":
                    self._json(401, {"error": {"message": "bad key"}})
                    return
                if trainer.delay:
                    time.sleep(trainer.delay)
                prompt = _prompt(body)
                if trainer.hold_after_first and not prompt.endswith(" step 0"):
                    trainer._dead.wait(600)
                    self.close_connection = True  # dropped unanswered
                    return
                with trainer._mu:
                    trainer.answered.append(prompt)
                text = f"ok: {prompt}"
                ids = [len(w) for w in text.split()]
                lps = [-0.1 * (i + 1) for i in range(len(ids))]
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.end_headers()
                    for i, word in enumerate(text.split()):
                        chunk = {
                            "id": "c1",
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {"content": word + " "},
                                    "token_ids": [ids[i]],
                                    "logprobs": {"content": [{"token": word, "logprob": lps[i]}]},
                                }
                            ],
                        }
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                self._json(
                    200,
                    {
                        "id": "c1",
                        "object": "chat.completion",
                        "model": body.get("model"),
                        "prompt_token_ids": [1, 2, 3],
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": text},
                                "token_ids": ids,
                                "logprobs": {
                                    "content": [
                                        {"token": w, "logprob": lp}
                                        for w, lp in zip(text.split(), lps, strict=True)
                                    ]
                                },
                                "finish_reason": "stop",
                            }
                        ],
                    },
                )

        self._server = _Server((self.host, 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._dead.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def prompts(self) -> list[str]:
        with self._mu:
            return [_prompt(c) for c in self.calls]


def _prompt(body: dict[str, Any]) -> str:
    msgs = body.get("messages")
    if isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict):
        return str(msgs[-1].get("content", ""))
    return str(body.get("prompt", ""))
