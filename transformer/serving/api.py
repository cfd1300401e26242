"""The HTTP API's contract, declared once: what POST /translate takes (its text, every field of
`SearchConfig`, attention) and answers, checked in one place (`parse_request`), what a request costs
(`request_cost`), and the OpenAPI document that publishes both (`openapi`, served at /openapi.json)."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from transformer.config import ConfigError, SearchConfig, ServeConfig, from_dict, to_dict

# What a request may choose: the search (the model's settings, its precision among them, stay the server's)
SETTINGS = [f.name for f in dataclasses.fields(SearchConfig)]
JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}
STRING, NUMBER, INTEGER, BOOLEAN = ({"type": kind} for kind in ("string", "number", "integer", "boolean"))
OPTIONAL_INTEGER = {"type": "integer", "nullable": True, "default": None}
LINK = {"type": "array", "items": INTEGER, "minItems": 2, "maxItems": 2}  # [source index, target index]


class BadRequest(Exception):
    """A request the server answers with a 4xx (or 503) status and {"error": message}."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Request:
    """A POST /translate body, checked: its lines, its search and its attention wishes."""

    lines: list[str]
    search: SearchConfig
    attention: bool
    attention_layer: int | None
    target_prefix: list[str] | None = None  # per line, what its translations start with
    constraints: list[list[str]] | None = None  # per line, the phrases its translations contain


def parse_request(body: bytes, cfg: ServeConfig, base: SearchConfig) -> Request:
    """A POST /translate body -> its lines and search (the request's settings over the server's, `base`);
    BadRequest if it is not a JSON object of the documented fields within the server's limits, or its
    settings are not a search translate.py would take."""
    try:
        request = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadRequest(f"the body is not JSON: {error}") from None
    except RecursionError:
        raise BadRequest("the body is not JSON this server reads: nested too deeply") from None
    if not isinstance(request, dict):
        raise BadRequest('the body must be a JSON object: {"text": [...]}')
    fields = ["text", "target_prefix", "constraints", "attention", "attention_layer", *SETTINGS]
    unknown = sorted(set(request) - set(fields))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    lines = _lines(request.get("text"), "text", cfg)
    prefixes = None
    if "target_prefix" in request:
        prefixes = _lines(request["target_prefix"], "target_prefix", cfg)
        if len(prefixes) != len(lines):
            raise BadRequest(f'{len(lines)} lines but {len(prefixes)} in "target_prefix": one per line')
    constraints = None
    if "constraints" in request:
        given = request["constraints"]
        one = (
            isinstance(request.get("text"), str)
            and isinstance(given, list)
            and all(isinstance(c, str) for c in given)
        )
        constraints = [_lines(phrases, "constraints", cfg) for phrases in ([given] if one else _list(given))]
        if len(constraints) != len(lines):
            raise BadRequest(
                f'{len(lines)} lines but {len(constraints)} in "constraints": a list of phrases per line'
            )
    try:
        search = from_dict(SearchConfig, to_dict(base) | {k: request[k] for k in SETTINGS if k in request})
    except ConfigError as error:
        raise BadRequest(str(error)) from None
    attention, layer = request.get("attention", False), request.get("attention_layer")
    if not isinstance(attention, bool):
        raise BadRequest('"attention" must be true or false')
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
        raise BadRequest('"attention_layer" must be a whole number')
    return Request(lines, search, attention, layer, prefixes, constraints)


def _lines(value: Any, field: str, cfg: ServeConfig) -> list[str]:
    """A request's `field`, a string or a list of them, checked: lines within the server's limits."""
    lines = [value] if isinstance(value, str) else value
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise BadRequest(f'"{field}" must be a string or a list of strings')
    if len(lines) > cfg.max_lines:
        raise BadRequest(
            f"{len(lines)} lines; a request takes at most {cfg.max_lines} (max_lines)",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        )
    for number, line in enumerate(lines):
        if not line.isascii() and _not_unicode(line):
            raise BadRequest(
                f"line {number} is not Unicode text: it holds a lone surrogate (\\ud800-\\udfff)"
            )
        if len(line) > cfg.max_chars:
            raise BadRequest(
                f"line {number} has {len(line)} characters; at most {cfg.max_chars} (max_chars)",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            )
    return [" ".join(line.splitlines()) for line in lines]


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise BadRequest(
            '"constraints" must be a list of phrases per line (for one "text", a list of phrases)'
        )
    return value


def _not_unicode(line: str) -> bool:
    """Whether JSON's escapes made a string no UTF-8 can hold (a lone surrogate)."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def request_cost(
    sources: list[list[int]],
    search: SearchConfig,
    attention: bool,
    grown: list[tuple[int, int]] | None = None,
) -> int:
    """What a request asks of the model: per source, its pieces x the rows decoded (the beam, or the
    samples) x its output limit (grown to hold its target prefix, then its constraints: grown's
    (prefix pieces, phrase pieces)), x nbest again where each hypothesis's attention is drawn or it is
    aligned."""
    cost, again = 0, search.nbest if attention or search.alignment else 1
    for ids, (prefix, phrases) in zip(sources, grown or [(0, 0)] * len(sources)):
        limit = max(int(search.max_len_a * len(ids) + search.max_len_b), prefix + 1) + phrases
        cost += len(ids) * search.width * limit * again
    return cost


def openapi(cfg: ServeConfig) -> dict[str, Any]:
    """The OpenAPI 3.0 document of the server's endpoints, its request fields read from SearchConfig."""
    hints = typing.get_type_hints(SearchConfig)
    settings = {
        f.name: {"type": JSON_TYPES[hints[f.name]], "default": getattr(cfg, f.name)}
        for f in dataclasses.fields(SearchConfig)
    }
    line = {"type": "string", "maxLength": cfg.max_chars}
    text = {"oneOf": [line, {"type": "array", "items": line, "maxItems": cfg.max_lines}]}
    attention = {"attention": BOOLEAN | {"default": False}, "attention_layer": OPTIONAL_INTEGER}
    phrases = {"type": "array", "items": line, "maxItems": cfg.max_lines}
    constraints = {"oneOf": [phrases, {"type": "array", "items": phrases, "maxItems": cfg.max_lines}]}
    request = _object(
        ["text"], text=text, target_prefix=text, constraints=constraints, **settings, **attention
    )
    request |= {"additionalProperties": False}
    hypothesis = _object(
        ["text", "score", "log_prob", "pieces", "token_log_probs"],
        text=STRING,
        score=NUMBER,
        log_prob=NUMBER,
        pieces=_array(STRING),
        token_log_probs=_array(NUMBER),
        attention={"type": "object"},
        alignment=_array(LINK),
        piece_alignment=_array(LINK),
    )
    translation = _object(["source", "hypotheses"], source=STRING, hypotheses=_array(hypothesis))
    answer = _object(
        ["id", "batch", "queued_ms", "run_ms", "translations"],
        id=STRING,
        batch=INTEGER,
        queued_ms=NUMBER,
        run_ms=NUMBER,
        translations=_array(translation),
    )
    error = _object(["error"], error=STRING)
    status = STRING | {"enum": ["ok", "draining"]}
    health = _object(
        ["status"], status=status, step=OPTIONAL_INTEGER, requests=INTEGER, batches=INTEGER, queue=INTEGER
    )

    def json_body(schema: dict, description: str) -> dict:
        return {"description": description, "content": {"application/json": {"schema": schema}}}

    errors = {
        str(status.value): json_body(error, status.phrase)
        for status in (
            HTTPStatus.BAD_REQUEST,
            HTTPStatus.REQUEST_TIMEOUT,
            HTTPStatus.LENGTH_REQUIRED,
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
            HTTPStatus.SERVICE_UNAVAILABLE,
            HTTPStatus.GATEWAY_TIMEOUT,
        )
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "Transformer translation", "version": "1"},
        "paths": {
            "/translate": {
                "post": {
                    "summary": "Translate lines with the server's model and a search of the request's",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                    "responses": {"200": json_body(answer, "the translations"), **errors},
                }
            },
            "/health": {
                "get": {
                    "summary": "Whether the server takes requests",
                    "responses": {
                        "200": json_body(health, "serving"),
                        "503": json_body(health, "draining: stopping"),
                    },
                }
            },
        },
    }


def _object(required: list[str], **properties: dict) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties}


def _array(items: dict) -> dict[str, Any]:
    return {"type": "array", "items": items}
