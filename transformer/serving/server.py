"""A local HTTP endpoint for translation (`scripts/serve.py`): a Starlette app on uvicorn, in front of
one model worker that batches requests fairly (batching.py); the contract is api.py's.

    POST /translate     {"text": "..." or [...], any field of SearchConfig, "attention", "attention_layer"}
                        -> {"id", "batch", "queued_ms", "run_ms", "translations": [{"source",
                            "hypotheses": [{"text", "score", "log_prob", "pieces", "token_log_probs",
                            "attention"?, "alignment"?, "piece_alignment"?}]}]}
    GET  /health        {"status": "ok" | "draining", "step", "requests", "batches", "queue"}
    GET  /metrics       Prometheus text: requests by path and status, latency, batch sizes, queue depth
    GET  /openapi.json  the contract
    GET  /              the attention explorer (transformer/serving/static/)

Every error is {"error": message} with its status, and the server keeps serving. Only
Host names of the loopback are served unless `allowed_hosts` says otherwise, and /translate takes
application/json alone, so that a web page elsewhere can neither reach it by DNS rebinding nor post to
it without a CORS preflight (which it refuses). SIGTERM or Ctrl-C drain it: the listener closes, new
requests get 503 with Connection: close, work in flight finishes within `shutdown_timeout_s`, exit 0;
what the drain's end cuts off, and a second signal, stop it at once with exit status 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from importlib import resources
from typing import Any, NoReturn

import h11
import prometheus_client as prometheus
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from transformer.config import ConfigError, ServeConfig
from transformer.inference.formats import translation_dict
from transformer.inference.translation import Guide, Translator, kept_whole, part_guides
from transformer.inference.visualize import attention_weights
from transformer.serving.api import BadRequest, openapi, parse_request, request_cost
from transformer.serving.batching import Batcher, Job, QueueFull

log = logging.getLogger(__name__)

BACKLOG = 2048  # connections the kernel queues before the server accepts them
LOOPBACK = ("localhost", "127.0.0.1", "::1")
POLL = 0.2  # seconds between looks at whether a waiting request's client is still there
INLINE_CHARS = 2000  # a request's text tokenized on the event loop up to this size, in a thread beyond
STATIC = {  # path -> (file in transformer/serving/static, content type)
    "/": ("index.html", "text/html"),
    "/explorer.js": ("explorer.js", "text/javascript"),
    "/explorer.css": ("explorer.css", "text/css"),
}
ROUTES = "GET /, /health, /metrics, /openapi.json; POST /translate"


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


class Metrics:
    """What /metrics reports, in a registry of the server's own."""

    def __init__(self, batcher: Batcher) -> None:
        self.registry = prometheus.CollectorRegistry()
        self.requests = prometheus.Counter(
            "http_requests",
            "Requests answered, by path and status",
            ["path", "status"],
            registry=self.registry,
        )
        self.latency = prometheus.Histogram(
            "translate_seconds",
            "Time from a POST /translate's arrival to its answer",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.batch = prometheus.Histogram(
            "batch_requests",
            "Requests translated together in one batch",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        queue = prometheus.Gauge("queue_depth", "Requests waiting for the model", registry=self.registry)
        queue.set_function(lambda: batcher.depth)


class Service:
    """The server's state: its settings, the model, the worker and the metrics; `draining` once stopping."""

    def __init__(self, cfg: ServeConfig, translator: Translator) -> None:
        self.cfg, self.translator = cfg, translator
        self.search = translator.cfg.search  # a request's settings go over these
        self.batcher = Batcher(self.work, cfg.batch_wait_ms / 1000, cfg.max_lines, cfg.max_queue)
        self.metrics = Metrics(self.batcher)
        self.draining = self.cut_off = False  # stopping; requests cut off by the drain's end
        names = cfg.allowed_hosts if cfg.allowed_hosts is not None else [*LOOPBACK, cfg.host]
        self.hosts = None if "*" in names else {_hostname(name) for name in names}

    def work(self, batch: list[Job]) -> None:
        """Translate the jobs still waited for in one batch and answer each (in the model's thread)."""
        jobs = [job for job in batch if not job.dropped]
        if not jobs:
            return
        self.metrics.batch.observe(len(jobs))
        sources = [parts for job in jobs for parts in job.sources]
        numbers = [i for job in jobs for i in range(len(job.request.lines))]  # each request's own samples
        guides = [g for job in jobs for g in job.guides or [Guide([], [])] * len(job.sources)]
        guided = guides if any(job.guides for job in jobs) else None
        try:
            found = self.translator.nbest_of(
                sources, first=numbers, search=jobs[0].request.search, guides=guided
            )
        except (ConfigError, ValueError) as error:
            for job in jobs:
                job.answer(error=BadRequest(str(error)))
            return
        start = 0
        for job in jobs:
            answers = []
            found_here = found[start : start + len(job.request.lines)]
            for line, parts, hypotheses in zip(job.request.lines, job.sources, found_here):
                answers.append(
                    {"source": line, "hypotheses": [self._hypothesis(parts, h, job) for h in hypotheses]}
                )
            start += len(job.request.lines)
            job.answer(
                {
                    "batch": self.batcher.batches,
                    "queued_ms": round((job.started - job.arrived) * 1e3, 1),
                    "run_ms": round((time.monotonic() - job.started) * 1e3, 1),
                    "translations": answers,
                }
            )

    def _hypothesis(self, parts: list[list[int]], h: Any, job: Job) -> dict[str, Any]:
        """A hypothesis' answer, with its attention where asked (null for a line translated in parts)."""
        entry = translation_dict(h)
        if job.request.attention:
            t = self.translator
            out_ids = t.tokenizer.encode(h.text) if h.text else []
            entry["attention"] = (
                attention_weights(t.model, t.tokenizer, parts[0], out_ids, job.request.attention_layer)
                if len(parts) == 1
                else None
            )
        return entry

    async def translate(self, request: Request) -> Response:
        """POST /translate: checked, costed and queued; answered when its batch is done."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise BadRequest(
                "POST /translate takes Content-Type: application/json", HTTPStatus.UNSUPPORTED_MEDIA_TYPE
            )
        body = await self._body(request)
        parsed = parse_request(body, self.cfg, self.search)
        translator = self.translator
        n_layers = translator.model.cfg.n_layers
        layer = parsed.attention_layer
        if layer is not None and not -n_layers <= layer < n_layers:
            raise BadRequest(f"attention_layer={layer} is out of range: the model has {n_layers} layers")
        try:
            translator.max_source_tokens(parsed.search)  # an output limit that leaves no room for a source
        except ConfigError as error:
            raise BadRequest(str(error)) from None
        try:
            guides = translator.guides(parsed.lines, parsed.target_prefix, parsed.constraints, parsed.search)
        except ConfigError as error:
            raise BadRequest(str(error)) from None
        args = (parsed.lines, parsed.search, kept_whole(guides))
        if sum(map(len, parsed.lines)) <= INLINE_CHARS:  # as quick as a hop to a thread
            sources = translator.encode(*args)
        else:
            sources = await run_in_threadpool(translator.encode, *args)
        each = part_guides(guides or [Guide([], [])] * len(sources), sources)
        grown = [(len(g.prefix), sum(map(len, g.phrases))) for g in each]
        flat = [part for parts in sources for part in parts]
        cost = request_cost(flat, parsed.search, parsed.attention, grown)
        if cost > self.cfg.max_request_cost:
            raise BadRequest(
                f"this request costs {cost:,} (source pieces x beam or samples x output limit, x nbest "
                "with attention or alignment); this server takes at most "
                f"max_request_cost={self.cfg.max_request_cost:,}: "
                "send fewer or shorter lines, or lower beam_size, nbest or max_len_b",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            )
        loop = asyncio.get_running_loop()
        job = Job(request.state.id, parsed, sources, loop.create_future(), loop, guides)
        try:
            self.batcher.submit(job)
        except QueueFull:
            raise BadRequest(
                f"{self.cfg.max_queue} requests wait already (max_queue); retry in a moment",
                HTTPStatus.SERVICE_UNAVAILABLE,
            ) from None
        answer = await self._answer(job, request)
        return JSONResponse({"id": job.id, **answer})

    async def _body(self, request: Request) -> bytes:
        """The request's body within max_body_bytes, arrived within read_timeout_s."""
        cfg = self.cfg
        length = request.headers.get("content-length")
        if length is None and "chunked" not in request.headers.get("transfer-encoding", "").lower():
            raise BadRequest("a POST needs a Content-Length", HTTPStatus.LENGTH_REQUIRED)
        size = length if length is not None else f"more than {cfg.max_body_bytes}"  # chunked: as it comes
        too_large = BadRequest(
            f"the body has {size} bytes; at most {cfg.max_body_bytes} (max_body_bytes)",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        )
        if length is not None and int(length) > cfg.max_body_bytes:  # h11 let digits alone through
            raise too_large
        body = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > cfg.max_body_bytes:
                    raise too_large

        try:
            await asyncio.wait_for(read(), cfg.read_timeout_s)
        except asyncio.TimeoutError:
            raise BadRequest(
                f"the body did not arrive within read_timeout_s={cfg.read_timeout_s:g}",
                HTTPStatus.REQUEST_TIMEOUT,
            ) from None
        except ClientDisconnect:
            raise ClientGone from None
        return bytes(body)

    async def _answer(self, job: Job, request: Request) -> dict[str, Any]:
        """The job's result once its batch is done; dropped (not run, or its answer dropped) when its
        client leaves or request_timeout_s passes first."""
        deadline = job.arrived + self.cfg.request_timeout_s
        try:
            return await self._wait(job, request, deadline)
        except BaseException:  # timed out, the client left, or the server cut it off: never run
            job.dropped = True
            raise

    async def _wait(self, job: Job, request: Request, deadline: float) -> dict[str, Any]:
        while not job.future.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise BadRequest(
                    f"no answer within request_timeout_s={self.cfg.request_timeout_s:g}",
                    HTTPStatus.GATEWAY_TIMEOUT,
                )
            await asyncio.wait([job.future], timeout=min(POLL, left))
            if not job.future.done() and await request.is_disconnected():
                raise ClientGone
        return job.future.result()

    async def health(self, request: Request) -> Response:
        batcher = self.batcher
        status = {"status": "draining" if self.draining else "ok", "step": self.translator.info.get("step")}
        status |= {"requests": batcher.requests, "batches": batcher.batches, "queue": batcher.depth}
        return JSONResponse(status, HTTPStatus.SERVICE_UNAVAILABLE if self.draining else HTTPStatus.OK)

    async def prometheus_metrics(self, request: Request) -> Response:
        return Response(
            prometheus.generate_latest(self.metrics.registry), media_type=prometheus.CONTENT_TYPE_LATEST
        )

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi(self.cfg))

    async def static(self, request: Request) -> Response:
        name, kind = STATIC[request.url.path]
        body = resources.files("transformer.serving").joinpath("static", name).read_bytes()
        return Response(body, media_type=f"{kind}; charset=utf-8")

    def app(self) -> Starlette:
        routes = [
            Route("/translate", self.translate, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus_metrics, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            *(Route(path, self.static, methods=["GET"]) for path in STATIC),
        ]
        handlers = {
            HTTPException: _http_error,
            BadRequest: _bad_request,
            ClientGone: _client_gone,
            Exception: _failed,
        }
        return Starlette(routes=routes, exception_handlers=handlers)


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status, headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == HTTPStatus.NOT_FOUND:
        return error(exc.status_code, f"no {request.url.path}: {ROUTES}")
    if exc.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
        return error(
            exc.status_code, f"{request.method} {request.url.path} is not served: {ROUTES}", exc.headers
        )
    return error(exc.status_code, str(exc.detail), exc.headers)


async def _bad_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadRequest)
    headers = {"Retry-After": "1"} if exc.status == HTTPStatus.SERVICE_UNAVAILABLE else {}
    if exc.status in (
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        HTTPStatus.REQUEST_TIMEOUT,
        HTTPStatus.LENGTH_REQUIRED,
    ):
        headers["Connection"] = "close"  # the body may be left unread
    return error(exc.status, str(exc), headers)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return error(499, "the client closed its connection")  # never read: nobody is there


async def _failed(request: Request, exc: Exception) -> Response:
    log.error("request %s failed", request.state.id, exc_info=exc)
    return error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")


class Guard:
    """ASGI middleware around the app: a request id, the Host check, 503 while draining, the metrics and
    one log line per request."""

    def __init__(self, app: Starlette, service: Service) -> None:
        self.app, self.service = app, service
        self.paths = {route.path for route in app.routes}  # the metrics' label; any other: "other"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        service, start = self.service, time.monotonic()
        rid = secrets.token_hex(6)
        scope.setdefault("state", {})["id"] = rid
        status = 0

        async def sending(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        host = _hostname(dict(scope["headers"]).get(b"host", b"").decode("latin-1"))
        if service.hosts is not None and host not in service.hosts:
            served = ", ".join(sorted(service.hosts))
            response = error(
                HTTPStatus.BAD_REQUEST,
                f"Host {host!r} is not served here ({served}); start the server with allowed_hosts=[...]",
            )
        elif service.draining and scope["path"] != "/health":
            response = error(
                HTTPStatus.SERVICE_UNAVAILABLE, "the server is stopping", {"Connection": "close"}
            )
        else:
            response = None
        try:
            await (response or self.app)(scope, receive, sending)
        except asyncio.CancelledError:  # the drain's time ran out: the request is cut off, and said so
            service.cut_off = True
            if not status:
                await error(HTTPStatus.SERVICE_UNAVAILABLE, "the server stopped", {"Connection": "close"})(
                    scope, receive, sending
                )
        except Exception:  # answered 500 already (and logged by `_failed`): not raised to uvicorn again
            if not status:
                raise
        finally:
            self.record(scope, status, start, rid)

    def record(self, scope: dict, status: int, start: float, rid: str) -> None:
        """The request in the metrics and the log."""
        service = self.service
        seconds = time.monotonic() - start
        path = scope["path"] if scope["path"] in self.paths else "other"
        service.metrics.requests.labels(path, str(status)).inc()
        if path == "/translate" and status == HTTPStatus.OK:
            service.metrics.latency.observe(seconds)
        log.info("%s %s %s %d %.0f ms", rid, scope["method"], scope["path"], status, seconds * 1e3)


def _hostname(host: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 (h11, a strict parser) with a deadline for a request's head (`read_timeout`
    from a connection's opening or a head's first byte: a client that stalls there is closed), a cap on open
    connections (`max_connections`: more get 503) and JSON for the errors it answers itself."""

    read_timeout: float = 10.0
    max_connections: int = 256

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            self._refuse(503, "too many open connections (max_connections); retry in a moment")
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._between_requests():  # a head's first bytes
            self._arm()
        super().data_received(data)
        if self._head_timer is not None and not self._between_requests():  # the head is parsed
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.read_timeout, self._expire)

    def _expire(self) -> None:
        self._head_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, f"not a valid HTTP/1.1 request: {msg}")

    def _refuse(self, status: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        try:
            output = self.conn.send(
                h11.Response(status_code=status, headers=[*head, (b"connection", b"close")])
            )
            output += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # h11 cannot answer in its state: a raw response
            reason = HTTPStatus(status).phrase.encode()
            output = b"HTTP/1.1 %d %s\r\n" % (status, reason)
            output += b"".join(k + b": " + v + b"\r\n" for k, v in head) + b"connection: close\r\n\r\n" + body
        self.transport.write(output)
        self.transport.close()


class Server(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM or Ctrl-C (`Service.draining`) and stopping at
    once on the second (exit status 1); the signals are `_run`'s to install, so that the process never
    dies of the signal itself."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # installed for the server's whole life by `_run`

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            _exit_now()
        log.warning(
            "draining: %d requests queued; stopping within %gs",
            self.service.batcher.depth,
            self.config.timeout_graceful_shutdown,
        )
        self.service.draining = True
        self.should_exit = True


def serve(cfg: ServeConfig, ready: threading.Event | None = None) -> None:
    """Load the checkpoint, listen on cfg.host:cfg.port until SIGTERM or Ctrl-C (in the main thread);
    `ready` is set once it listens."""
    sock = _bind(cfg.host, cfg.port)  # before the model loads: a port taken is said at once
    try:
        translator = Translator.from_checkpoint(cfg)
        with translator.packed():  # the weights packed once for the server's life, not for every batch
            _run(cfg, translator, sock, ready)
    finally:
        sock.close()


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)  # connections queue from now on, until the server accepts them
    except OSError as error:
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def _run(
    cfg: ServeConfig, translator: Translator, sock: socket.socket, ready: threading.Event | None
) -> None:
    service = Service(cfg, translator)
    protocol = type(
        "Protocol", (Protocol,), {"read_timeout": cfg.read_timeout_s, "max_connections": cfg.max_connections}
    )
    config = uvicorn.Config(
        Guard(service.app(), service),
        http=protocol,
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        backlog=BACKLOG,
        timeout_keep_alive=cfg.keep_alive_s,
        timeout_graceful_shutdown=cfg.shutdown_timeout_s,
    )
    server = Server(config, service)
    service.batcher.start()
    main = threading.current_thread() is threading.main_thread()  # signals reach the main thread only
    previous = (
        {s: signal.signal(s, server.handle_exit) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    )
    host, port = sock.getsockname()[:2]
    log.warning("serving %s on http://%s:%d (GET / for the attention explorer)", cfg.checkpoint, host, port)
    if ready is not None:
        ready.set()
    try:
        server.run(sockets=[sock])
        drained = not service.cut_off and service.batcher.stop(timeout=cfg.shutdown_timeout_s)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if not drained:
        _exit_now()
    log.warning("stopped")


def _exit_now() -> NoReturn:
    """Exit status 1 at once (a second signal, or requests the drain cut off): the model's thread may
    be inside a batch, which Python's own exit would wait for or abort on."""
    log.warning("stopped at once, with requests unanswered")
    logging.shutdown()
    os._exit(1)
