"""The model gateway: the only way a hosted rollout's scaffold reaches the model.

An OpenAI-compatible endpoint (``/v1/chat/completions``, ``/v1/completions``, streaming
relayed as it comes, ``/v1/models``) that the edge serves on the host side of every
agent sandbox's veth (``NetworkManager.service_ports`` lets sandboxes reach it, the way
they reach the DNS responder). The scaffold finds it in ``OPENAI_BASE_URL`` and its
rollout's token in ``OPENAI_API_KEY``; the trainer's real key never enters a sandbox.

A call is forwarded to the job's *current* endpoint, re-read on every attempt, so
``set_model_endpoint`` moves held calls to a trainer that came back elsewhere. When the
endpoint does not answer (refused, reset, timeout, 5xx) the call is held and retried
with backoff until it goes through or the rollout's deadline passes; the host is told
of the hold (it marks the rollout ``waiting_for_model`` and, after ``pause_after``,
pauses the sandbox) and of the call going through (it thaws the sandbox first, so the
answer lands in a running scaffold). Every call the scaffold sees answered is one
``model_call`` step in the trajectory log, with its failed attempts listed in it.

Who may call: the bearer token names a live rollout, and the caller's address must be
that rollout's sandbox (the edge's reverse-path filter stops a sandbox from spoofing
another's address). What one rollout may do is bounded: calls in flight, body size,
``max_steps``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dsec.api.rollouts import ModelEndpoint

log = logging.getLogger(__name__)

#: Calls one rollout may have in flight (a scaffold makes one at a time, a few at most).
MAX_INFLIGHT = 8
MAX_BODY = 8 << 20
#: What of a streamed answer is kept for the log (the relay itself is not bounded).
MAX_RECORDED = 4 << 20
BACKOFF_FIRST = 0.2
BACKOFF_MAX = 2.0
CONNECT_TIMEOUT = 5.0
CLIENT_RETRY_HEADER = "x-stainless-retry-count"
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class GatewayRollout(Protocol):
    """What the gateway needs of one rollout (dsec.rollouts.manager.Worker)."""

    inflight: int

    @property
    def id(self) -> str: ...
    @property
    def deadline(self) -> float: ...
    @property
    def max_steps(self) -> int | None: ...
    @property
    def calls_made(self) -> int: ...


class GatewayHost(Protocol):
    """The rollout manager, as the gateway sees it."""

    def by_token(self, token: str) -> GatewayRollout | None: ...
    def caller_ok(self, ro: GatewayRollout, peer: str) -> bool: ...
    def endpoint_for(self, ro: GatewayRollout) -> ModelEndpoint | None: ...
    async def held(self, ro: GatewayRollout, since: float) -> None: ...
    async def through(self, ro: GatewayRollout) -> None: ...
    def record(
        self, ro: GatewayRollout, request: dict[str, Any], ok: bool, result: dict[str, Any]
    ) -> None: ...


@dataclass
class _Call:
    path: str
    body: dict[str, Any]
    started: float = field(default_factory=time.monotonic)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    #: The scaffold's own retry of a call it saw fail (e.g. its connection reset when
    #: an edge died holding it: dsec.rollouts.listener), as its client numbers it.
    client_retry: int = 0

    def request_record(self) -> dict[str, Any]:
        return {"path": self.path, "body": self.body}

    def client(self) -> dict[str, Any]:
        return {"client_retry": self.client_retry} if self.client_retry else {}


def client_retry(headers: Any) -> int:
    """``x-stainless-retry-count`` (the OpenAI SDKs send it): 0 when absent or odd."""
    raw = headers.get(CLIENT_RETRY_HEADER) or "0"
    return int(raw) if raw.isdigit() and len(raw) <= 4 else 0


def _error(status: int, message: str, kind: str = "gateway_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def rl_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Token ids and logprobs of every choice, as the model server returned them (vLLM:
    ``token_ids``/``prompt_token_ids``; OpenAI: ``logprobs.content``; completions:
    ``logprobs.tokens``/``token_logprobs``): what an RL trainer needs from a call."""
    out: dict[str, Any] = {}
    if "prompt_token_ids" in body:
        out["prompt_token_ids"] = body["prompt_token_ids"]
    choices = body.get("choices")
    if not isinstance(choices, list):
        return out
    ids: list[Any] = []
    lps: list[Any] = []
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        tids = ch.get("token_ids")
        ids.append(tids if tids else None)
        lp = ch.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            lps.append([t.get("logprob") for t in lp["content"] if isinstance(t, dict)])
        elif isinstance(lp, dict) and isinstance(lp.get("token_logprobs"), list):
            lps.append(lp["token_logprobs"])
        elif isinstance(lp, list) and lp:  # a streamed answer, merged (merge_stream)
            lps.append(lp)
        else:
            lps.append(None)
    if any(i is not None for i in ids):
        out["token_ids"] = ids
    if any(lp is not None for lp in lps):
        out["logprobs"] = lps
    return out


def merge_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer from the SSE chunks of a streamed call: text, token ids and logprobs
    joined per choice (what the log keeps; the scaffold got the chunks as they came)."""
    merged: dict[int, dict[str, Any]] = {}
    head: dict[str, Any] = {}
    for ev in events:
        for key in ("id", "model", "created", "usage", "prompt_token_ids"):
            if ev.get(key) is not None:
                head[key] = ev[key]
        for ch in ev.get("choices") or []:
            if not isinstance(ch, dict):
                continue
            m = merged.setdefault(
                int(ch.get("index", 0)), {"text": "", "token_ids": [], "logprobs": []}
            )
            delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else None
            text = (delta or {}).get("content") if delta is not None else ch.get("text")
            if isinstance(text, str):
                m["text"] += text
            if isinstance(ch.get("token_ids"), list):
                m["token_ids"] += ch["token_ids"]
            lp = ch.get("logprobs")
            if isinstance(lp, dict) and isinstance(lp.get("content"), list):
                m["logprobs"] += [t.get("logprob") for t in lp["content"] if isinstance(t, dict)]
            if ch.get("finish_reason") is not None:
                m["finish_reason"] = ch["finish_reason"]
    head["choices"] = [{"index": i, **merged[i]} for i in sorted(merged)]
    return head


def _quiet_server_class() -> type[Any]:
    import uvicorn

    class QuietServer(uvicorn.Server):
        """Signals are the platform's (dsec.roots.serving): this server only serves."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return QuietServer


class ModelGateway:
    """The HTTP endpoint and the forwarding; state lives in the host (the manager)."""

    def __init__(self, host: GatewayHost, port: int) -> None:
        self.host = host
        self.port = port
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256),
            follow_redirects=False,
        )
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ]
        )

    # -- serving ----------------------------------------------------------------------------
    async def start(self, sock: socket.socket | None = None) -> None:
        """Listen on every address (each sandbox reaches its own veth's host side) at a
        port that stays the same across edge restarts (scaffolds have it in their env).
        ``sock``: that port's listening socket, made already (dsec.rollouts.listener)."""
        import uvicorn

        _QuietServer = _quiet_server_class()
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", self.port))
            except OSError:
                sock.close()
                await self._client.aclose()
                raise
            sock.listen(1024)
        sock.setblocking(False)
        from dsec.apiserver.httpguard import ConnectionLimits, guarded_protocol

        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=75,
            lifespan="off",
            # Header timeout and size, connection cap: the same guard as the API's.
            http=guarded_protocol(ConnectionLimits.from_env()),
        )
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        for _ in range(200):
            if self._server.started:
                return
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._task, 5)
        await self._client.aclose()

    # -- routes -----------------------------------------------------------------------------
    async def _models(self, request: Request) -> Response:
        ro = self._caller(request)
        if isinstance(ro, Response):
            return ro
        ep = self.host.endpoint_for(ro)
        name = ep.model if ep is not None and ep.model else "default"
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def _chat(self, request: Request) -> Response:
        return await self._forward(request, "/chat/completions")

    async def _completions(self, request: Request) -> Response:
        return await self._forward(request, "/completions")

    def _caller(self, request: Request) -> GatewayRollout | Response:
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        ro = self.host.by_token(token) if token else None
        if ro is None:
            return _error(401, "unknown rollout token", "authentication_error")
        peer = request.client.host if request.client is not None else ""
        if not self.host.caller_ok(ro, peer):
            return _error(403, "this token belongs to another sandbox", "permission_error")
        return ro

    async def _forward(self, request: Request, path: str) -> Response:
        ro = self._caller(request)
        if isinstance(ro, Response):
            return ro
        if ro.inflight >= MAX_INFLIGHT:
            return _error(429, f"at most {MAX_INFLIGHT} model calls in flight", "rate_limit")
        if ro.max_steps is not None and ro.calls_made + ro.inflight >= ro.max_steps:
            return _error(429, f"this rollout's max_steps ({ro.max_steps}) is used up", "max_steps")
        size = int(request.headers.get("content-length") or 0)
        if size > MAX_BODY:
            return _error(413, f"request body over {MAX_BODY} bytes")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                return _error(413, f"request body over {MAX_BODY} bytes")
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request_error")
        ro.inflight += 1
        call = _Call(path, body, client_retry=client_retry(request.headers))
        try:
            if body.get("stream"):
                return await self._stream(ro, call)
            return await self._once(ro, call)
        except BaseException:
            ro.inflight -= 1
            raise

    # -- forwarding -----------------------------------------------------------------------
    def _target(
        self, ro: GatewayRollout, call: _Call
    ) -> tuple[str, dict[str, str], dict[str, Any]] | None:
        ep = self.host.endpoint_for(ro)
        if ep is None:
            return None
        headers = {"content-type": "application/json"}
        if ep.api_key:
            headers["authorization"] = f"Bearer {ep.api_key}"
        body = dict(call.body)
        if ep.model:
            body["model"] = ep.model
        return ep.base_url + call.path, headers, body

    def _timeout(self, ro: GatewayRollout) -> httpx.Timeout:
        left = max(1.0, ro.deadline - time.time())
        return httpx.Timeout(min(left, 3600.0), connect=min(left, CONNECT_TIMEOUT))

    async def _attempt_failed(self, ro: GatewayRollout, call: _Call, why: str) -> bool:
        """Note a failed attempt and wait before the next; False: the deadline passed."""
        call.attempts.append({"at": time.time(), "error": why[:300]})
        await self.host.held(ro, call.started)
        delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** min(len(call.attempts) - 1, 8))
        if time.time() + delay >= ro.deadline:
            return False
        await asyncio.sleep(delay)
        return True

    async def _once(self, ro: GatewayRollout, call: _Call) -> Response:
        try:
            while True:
                target = self._target(ro, call)
                if target is None:
                    if not await self._attempt_failed(ro, call, "no model endpoint for the job"):
                        return self._gave_up(ro, call)
                    continue
                url, headers, body = target
                t0 = time.perf_counter()
                try:
                    resp = await self._client.post(
                        url, json=body, headers=headers, timeout=self._timeout(ro)
                    )
                except httpx.HTTPError as exc:
                    why = f"{type(exc).__name__}: {exc}"
                else:
                    if resp.status_code not in RETRYABLE_STATUS:
                        latency = time.perf_counter() - t0
                        await self.host.through(ro)
                        return self._answered(ro, call, url, resp, latency)
                    why = f"HTTP {resp.status_code}"
                if not await self._attempt_failed(ro, call, why):
                    return self._gave_up(ro, call)
        finally:
            ro.inflight -= 1

    def _answered(
        self, ro: GatewayRollout, call: _Call, url: str, resp: httpx.Response, latency: float
    ) -> Response:
        try:
            answer = resp.json()
        except ValueError:
            answer = {"text": resp.text[:MAX_RECORDED]}
        ok = resp.status_code < 400
        result: dict[str, Any] = {
            "status": resp.status_code,
            "response": answer,
            "latency": round(latency, 6),
            "endpoint": url,
            "attempts": len(call.attempts) + 1,
            "retries": call.attempts,
            **call.client(),
            # time in the gateway from the body read to the answer ready (upstream
            # included): minus ``latency``, what the gateway itself added
            "handled": round(time.monotonic() - call.started, 6),
        }
        if isinstance(answer, dict):
            result.update(rl_fields(answer))
        self.host.record(ro, call.request_record(), ok, result)
        return Response(
            resp.content,
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "application/json"),
        )

    def _gave_up(self, ro: GatewayRollout, call: _Call) -> Response:
        self.host.record(
            ro,
            call.request_record(),
            False,
            {
                "status": 504,
                "error": "deadline passed",
                "attempts": len(call.attempts),
                "retries": call.attempts,
                **call.client(),
            },
        )
        return _error(504, "the model endpoint did not come back before the rollout's deadline")

    async def _stream(self, ro: GatewayRollout, call: _Call) -> Response:
        while True:
            target = self._target(ro, call)
            if target is None:
                if not await self._attempt_failed(ro, call, "no model endpoint for the job"):
                    ro.inflight -= 1
                    return self._gave_up(ro, call)
                continue
            url, headers, body = target
            t0 = time.perf_counter()
            try:
                req = self._client.build_request(
                    "POST", url, json=body, headers=headers, timeout=self._timeout(ro)
                )
                resp = await self._client.send(req, stream=True)
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code not in RETRYABLE_STATUS:
                    await self.host.through(ro)
                    return StreamingResponse(
                        self._relay(ro, call, url, resp, t0),
                        status_code=resp.status_code,
                        media_type=resp.headers.get("content-type", "text/event-stream"),
                    )
                await resp.aclose()
                why = f"HTTP {resp.status_code}"
            if not await self._attempt_failed(ro, call, why):
                ro.inflight -= 1
                return self._gave_up(ro, call)

    async def _relay(
        self, ro: GatewayRollout, call: _Call, url: str, resp: httpx.Response, t0: float
    ) -> AsyncIterator[bytes]:
        kept = bytearray()
        ok = resp.status_code < 400
        error: str | None = None
        try:
            async for chunk in resp.aiter_raw():
                if len(kept) < MAX_RECORDED:
                    kept += chunk[: MAX_RECORDED - len(kept)]
                yield chunk
        except httpx.HTTPError as exc:  # the trainer died mid-stream: the scaffold sees it
            ok, error = False, f"{type(exc).__name__}: {exc}"
        finally:
            await resp.aclose()
            ro.inflight -= 1
            events = []
            for line in kept.decode(errors="replace").splitlines():
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                    with contextlib.suppress(ValueError):
                        events.append(json.loads(line[5:]))
            answer = merge_stream([e for e in events if isinstance(e, dict)])
            result: dict[str, Any] = {
                "status": resp.status_code,
                "stream": True,
                "response": answer,
                "chunks": len(events),
                "latency": round(time.perf_counter() - t0, 6),
                "endpoint": url,
                "attempts": len(call.attempts) + 1,
                "retries": call.attempts,
                **call.client(),
            }
            if error is not None:
                result["error"] = error
            result.update(rl_fields(answer))
            self.host.record(ro, call.request_record(), ok, result)
