"""A local HTTP endpoint for translation (`scripts/serve.py`), on the standard library's threading HTTP
server: one thread per connection parses and checks a request, and one model worker thread, the only
one that touches the model (and the CPU kernels' packed weights), translates the requests queued within
`batch_wait_ms` of each other in one batch, those with the same search settings together.

    GET  /health     {"status": "ok", "checkpoint", "step", "requests", "batches"}
    POST /translate  {"text": "..." or ["...", ...], any field of SearchConfig ("beam_size", "alpha",
                      "nbest", "sampling", ...), "attention": bool, "attention_layer": int}
                     -> {"batch": n, "translations": [{"source", "hypotheses": [{"text", "score",
                         "log_prob", "pieces", "token_log_probs", "attention"?}]}]}
    GET  /           the attention explorer (transformer/serving/static/)

A bad request (malformed JSON, a wrong type or value, too large a body, too many lines, too long a line)
is answered 4xx with {"error": message}; the server keeps serving. SIGTERM or Ctrl-C stop it cleanly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import signal
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from transformer.config import ConfigError, SearchConfig, ServeConfig, from_dict, to_dict
from transformer.inference.formats import translation_dict
from transformer.inference.translation import Translator
from transformer.inference.visualize import attention_weights

log = logging.getLogger(__name__)

# What a request may choose: the search (the model's settings, its precision among them, stay the server's)
SETTINGS = [f.name for f in dataclasses.fields(SearchConfig)]
STATIC = {  # path -> (file in transformer/serving/static, content type)
    "/": ("index.html", "text/html"),
    "/explorer.js": ("explorer.js", "text/javascript"),
    "/explorer.css": ("explorer.css", "text/css"),
}


class BadRequest(Exception):
    """A request the server answers with a 4xx status and the message."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Job:
    """One request's lines and search, and the future its handler waits on."""

    lines: list[str]
    search: SearchConfig
    attention: bool
    attention_layer: int | None
    result: Future


class ModelWorker(threading.Thread):
    """The one thread that runs the model: takes the queued jobs, batches those with the same settings
    that arrive within `wait` seconds of the first, translates them together."""

    def __init__(self, translator: Translator, wait: float, max_lines: int) -> None:
        super().__init__(daemon=True, name="model-worker")
        self.translator, self.wait, self.max_lines = translator, wait, max_lines
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.batches = 0
        self.requests = 0

    def run(self) -> None:
        held: list[Job] = []  # taken from the queue, for a later batch (other settings)
        while True:
            job = held.pop(0) if held else self.jobs.get()
            if job is None:
                return
            batch, stop = [job], False
            while sum(len(j.lines) for j in batch) < self.max_lines:
                try:
                    other = self.jobs.get(timeout=self.wait)
                except queue.Empty:
                    break
                if other is None:
                    stop = True
                    break
                (batch if other.search == job.search else held).append(other)
            self._translate(batch)
            if stop:
                for job in held:
                    job.result.set_exception(
                        BadRequest("the server is stopping", HTTPStatus.SERVICE_UNAVAILABLE)
                    )
                return

    def _translate(self, batch: list[Job]) -> None:
        """Translate the jobs' lines in one batch and answer each job (an error answers them all: the
        worker itself never stops on one)."""
        self.batches += 1
        self.requests += len(batch)
        try:
            lines = [line for job in batch for line in job.lines]
            # each request's lines numbered on their own: its samples, whatever it is batched with
            numbers = [i for job in batch for i in range(len(job.lines))]
            found = self.translator.translate_nbest(lines, first=numbers, search=batch[0].search)
            start = 0
            for job in batch:
                answers = []
                for line, hypotheses in zip(job.lines, found[start : start + len(job.lines)]):
                    entries = [self._hypothesis(line, h, job) for h in hypotheses]
                    answers.append({"source": line, "hypotheses": entries})
                start += len(job.lines)
                job.result.set_result({"batch": self.batches, "translations": answers})
        except (ConfigError, ValueError) as error:
            self._fail(batch, BadRequest(str(error)))
        except Exception as error:  # the model failed (out of memory, ...): answer, keep serving
            log.exception("translation failed")
            self._fail(batch, error)

    @staticmethod
    def _fail(batch: list[Job], error: Exception) -> None:
        for job in batch:
            if not job.result.done():
                job.result.set_exception(error)

    def _hypothesis(self, source: str, h: Any, job: Job) -> dict[str, Any]:
        entry = translation_dict(h)
        if job.attention:
            t = self.translator
            src_ids, out_ids = t.encode([source])[0], t.tokenizer.encode(h.text) if h.text else []
            entry["attention"] = attention_weights(
                t.model, t.tokenizer, src_ids, out_ids, job.attention_layer
            )
        return entry

    def stop(self) -> None:
        self.jobs.put(None)


def parse_request(
    body: bytes, limits: dict[str, int], base: SearchConfig
) -> tuple[list[str], SearchConfig, bool, int | None]:
    """A POST /translate body -> its lines, its search (the request's settings over the server's, `base`)
    and attention wishes; BadRequest if it is not a JSON object of the documented fields within the
    limits, or its settings are not a search translate.py would take."""
    try:
        request = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadRequest(f"the body is not JSON: {error}") from None
    except RecursionError:
        raise BadRequest("the body is not JSON this server reads: nested too deeply") from None
    if not isinstance(request, dict):
        raise BadRequest('the body must be a JSON object: {"text": [...]}')
    fields = ["text", "attention", "attention_layer", *SETTINGS]
    unknown = sorted(set(request) - set(fields))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    text = request.get("text")
    lines = [text] if isinstance(text, str) else text
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise BadRequest('"text" must be a string or a list of strings')
    if len(lines) > limits["max_lines"]:
        raise BadRequest(
            f"{len(lines)} lines; a request takes at most {limits['max_lines']}",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        )
    for number, line in enumerate(lines):
        if not line.isascii() and _not_unicode(line):
            raise BadRequest(
                f"line {number} is not Unicode text: it holds a lone surrogate (\\ud800-\\udfff)"
            )
        if len(line) > limits["max_chars"]:
            raise BadRequest(
                f"line {number} has {len(line)} characters; at most {limits['max_chars']}",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            )
    lines = [" ".join(line.splitlines()) for line in lines]
    try:
        search = from_dict(SearchConfig, to_dict(base) | {k: request[k] for k in SETTINGS if k in request})
    except ConfigError as error:
        raise BadRequest(str(error)) from None
    attention = request.get("attention", False)
    layer = request.get("attention_layer")
    if not isinstance(attention, bool):
        raise BadRequest('"attention" must be true or false')
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
        raise BadRequest('"attention_layer" must be a whole number')
    return lines, search, attention, layer


def _not_unicode(line: str) -> bool:
    """Whether JSON's escapes made a string no UTF-8 can hold (a lone surrogate)."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class Server(ThreadingHTTPServer):
    """The HTTP server with its model worker and limits."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], translator: Translator, limits: dict[str, int], wait: float):
        super().__init__(address, Handler)
        self.translator, self.limits = translator, limits
        self.search = translator.cfg.search  # a request's settings go over these
        self.worker = ModelWorker(translator, wait, limits["max_lines"])
        self.worker.start()

    def server_close(self) -> None:
        self.worker.stop()
        self.worker.join(timeout=60)
        super().server_close()


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/health":
            worker, info = self.server.worker, self.server.translator.info
            checkpoint = self.server.translator.cfg.checkpoint
            health = {"status": "ok", "checkpoint": checkpoint, "step": info.get("step")}
            self._json(HTTPStatus.OK, {**health, "requests": worker.requests, "batches": worker.batches})
        elif self.path in STATIC:
            name, kind = STATIC[self.path]
            body = resources.files("transformer.serving").joinpath("static", name).read_bytes()
            self._send(HTTPStatus.OK, body, f"{kind}; charset=utf-8")
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no {self.path}: GET /, /health; POST /translate"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/translate":
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no {self.path}: POST /translate"})
            return
        try:
            translator, server = self.server.translator, self.server
            lines, search, attention, layer = parse_request(self._body(), server.limits, server.search)
            try:
                translator.max_source_tokens(search)  # an output limit that leaves no room for a source
            except ConfigError as error:
                raise BadRequest(str(error)) from None
            n_layers = translator.model.cfg.n_layers
            if layer is not None and not -n_layers <= layer < n_layers:
                raise BadRequest(f"attention_layer={layer} is out of range: the model has {n_layers} layers")
            job = Job(lines, search, attention, layer, Future())
            self.server.worker.jobs.put(job)
            self._json(HTTPStatus.OK, job.result.result(timeout=600))
        except BadRequest as error:
            self._json(error.status, {"error": str(error)})
        except Exception as error:  # the model's failure: a 500 with its message, the server goes on
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(error).__name__}: {error}"})

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise BadRequest("a POST needs a Content-Length", HTTPStatus.LENGTH_REQUIRED)
        if int(length) > self.server.limits["max_body_bytes"]:
            self.close_connection = True  # the body is not read
            raise BadRequest(
                f"the body has {length} bytes; at most {self.server.limits['max_body_bytes']}",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            )
        return self.rfile.read(int(length))

    def _json(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        self._send(status, json.dumps(payload, ensure_ascii=False).encode("utf-8"), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        log.info("%s %s", self.address_string(), format % args)


def serve(cfg: ServeConfig, ready: threading.Event | None = None) -> None:
    """Load the checkpoint, listen on cfg.host:cfg.port until SIGTERM or Ctrl-C (in the main thread)
    or `stop()`; `ready` is set once it listens."""
    translator = Translator.from_checkpoint(cfg)
    with translator.packed():  # the weights packed once for the server's life, not for every batch
        _listen(cfg, translator, ready)


def _listen(cfg: ServeConfig, translator: Translator, ready: threading.Event | None) -> None:
    limits = {"max_body_bytes": cfg.max_body_bytes, "max_lines": cfg.max_lines, "max_chars": cfg.max_chars}
    try:
        server = Server((cfg.host, cfg.port), translator, limits, cfg.batch_wait_ms / 1000)
    except OSError as error:
        raise ConfigError(f"cannot listen on {cfg.host}:{cfg.port}: {error.strerror or error}") from None
    stopping = threading.Thread(target=server.shutdown, daemon=True)  # shutdown() waits: not in a handler
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda *_: stopping.start())
    host, port = server.server_address[:2]
    log.warning("serving %s on http://%s:%d (GET / for the attention explorer)", cfg.checkpoint, host, port)
    if ready is not None:
        ready.set()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
