"""scripts/serve.py as people deploy it, spoken to over real sockets on localhost: fair batching across
settings, a cost cap, a full queue, timeouts and clients that leave, slow and malformed HTTP, the Host
and content-type guards, metrics, graceful shutdown, and the OpenAPI contract fuzzed with schemathesis."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from test_serve import CHECKPOINT, LINES, ROOT, Running, together

SLOW = ("batch_wait_ms=1500", "device=cpu")  # a batch waits 1.5 s for company: requests meet in the queue
JSON_POST = b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def raw(running: Running, data: bytes, wait: float = 5.0) -> bytes:
    """What the server sends back on one connection to `data`, until it closes it or `wait` passes."""
    with socket.create_connection((running.host, running.port), timeout=wait) as sock:
        sock.sendall(data)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            pass
        return received


def health(running: Running) -> dict:
    return running.request("GET", "/health")[1]


@pytest.fixture(scope="module")
def server():
    running = Running(
        "device=cpu", "batch_wait_ms=300", "max_lines=8", "max_request_cost=200000", "read_timeout_s=1"
    )
    yield running
    running.process.kill()


def test_a_rare_setting_waits_no_longer_than_the_wait_and_requests_behind_it_batch_together():
    """One beam_size=2 request, then three default ones: two batches (the old server ran four: the
    requests set aside behind a rarer setting went one by one)."""
    running = Running(*SLOW)
    try:
        first = together(running, [{"text": [LINES[0]], "beam_size": 2}])
        assert first[0][0] == 200
        answers = together(
            running,
            [{"text": [LINES[0]], "beam_size": 2}] + [{"text": [line]} for line in (*LINES, LINES[0])],
        )
        assert all(status == 200 for status, _ in answers)
        batches = [answer["batch"] for _, answer in answers]
        assert len(set(batches[1:])) == 1 and batches[0] != batches[1]
        assert health(running)["batches"] == 3
    finally:
        running.process.kill()


def test_a_batch_waits_from_its_first_request_not_from_the_last(server):
    """Requests 100 ms apart for 1.2 s against a 300 ms wait: several batches (a wait restarted by
    every arrival would have made them one)."""
    answers, threads = [None] * 12, []

    def ask(i: int) -> None:
        answers[i] = server.translate({"text": [LINES[i % 2]]})

    for i in range(12):
        threads.append(threading.Thread(target=ask, args=(i,)))
        threads[-1].start()
        time.sleep(0.1)
    for thread in threads:
        thread.join(timeout=120)
    assert all(status == 200 for status, _ in answers)
    assert len({answer["batch"] for _, answer in answers}) >= 2
    first = answers[0][1]
    assert set(first) == {"id", "batch", "queued_ms", "run_ms", "translations"}
    assert 250 <= first["queued_ms"] and first["run_ms"] > 0


def test_a_request_over_the_cost_cap_is_refused_naming_the_limit(server):
    status, answer = server.translate({"text": [LINES[1]], "beam_size": 1024})
    assert status == 413 and "max_request_cost=200,000" in answer["error"]
    status, answer = server.translate({"text": [LINES[1]] * 8, "beam_size": 8, "nbest": 8, "attention": True})
    assert status == 413 and "x nbest with attention" in answer["error"]
    assert server.translate({"text": [LINES[1]], "beam_size": 8})[0] == 200


def test_a_full_queue_answers_503_with_retry_after():
    running = Running(*SLOW, "max_queue=1")
    try:
        statuses = []
        for status, answer in together(running, [{"text": [line]} for line in (*LINES, LINES[0])]):
            statuses.append(status)
            if status == 503:
                assert "max_queue" in answer["error"]
        assert sorted(statuses) == [200, 503, 503]
        waiting = threading.Thread(target=running.translate, args=({"text": LINES},))
        waiting.start()  # the queue's one place taken for its 1.5 s
        time.sleep(0.5)
        connection = http.client.HTTPConnection(running.host, running.port, timeout=30)
        connection.request(
            "POST", "/translate", json.dumps({"text": LINES}), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        assert response.status == 503 and response.getheader("Retry-After") == "1"
        connection.close()
        waiting.join(timeout=60)
        assert running.translate({"text": LINES})[0] == 200
    finally:
        running.process.kill()


def test_a_request_past_its_timeout_gets_504_and_is_never_run():
    running = Running(*SLOW, "request_timeout_s=0.5")
    try:
        status, answer = running.translate({"text": LINES})
        assert status == 504 and "request_timeout_s=0.5" in answer["error"]
        time.sleep(1.5)
        assert health(running)["batches"] == 0 and health(running)["queue"] == 0
    finally:
        running.process.kill()


def test_a_request_whose_client_left_is_dropped_before_it_runs():
    running = Running(*SLOW)
    try:
        body = json.dumps({"text": LINES}).encode()
        with socket.create_connection((running.host, running.port)) as sock:
            sock.sendall(JSON_POST + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.3)
        time.sleep(2.0)
        assert health(running)["batches"] == 0
        assert running.translate({"text": LINES[0]})[0] == 200
    finally:
        running.process.kill()


def test_a_client_that_stalls_in_its_head_or_body_is_cut_off(server):
    """read_timeout_s=1: a connection that sends nothing, or a head never finished, is closed; a body
    that promises 100 bytes and sends 7 is answered 408 and the connection closed."""
    for stalled in (b"", b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\n"):
        start = time.monotonic()
        assert raw(server, stalled, wait=10) == b""
        assert time.monotonic() - start < 5  # closed by the server, not by the wait
    start = time.monotonic()
    answer = raw(server, JSON_POST + b"Content-Length: 100\r\n\r\n" + b'{"text"', wait=10)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"read_timeout_s=1" in answer
    assert b"connection: close" in answer.lower() and time.monotonic() - start < 5


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: -1",
        b"Content-Length: 2\r\nContent-Length: 3",
        "Content-Length: \u00b2".encode(),
    ],
)
def test_a_malformed_request_gets_one_json_400_and_the_connection_closes(server, head):
    """What follows a bad Content-Length is never read as a second request (no smuggling)."""
    second = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    data = b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\n" + head + b"\r\n\r\n{}" + second
    answer = raw(server, data)
    assert len(re.findall(rb"(?:^|\r\n)HTTP/1\.1 \d{3} ", answer)) == 1 and answer.startswith(
        b"HTTP/1.1 400 "
    )
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"].startswith("not a valid HTTP/1.1 request")


def test_only_loopback_hosts_and_json_bodies_are_served(server):
    status, answer = server.request("GET", "/health", headers={"Host": "attacker.example"})
    assert status == 400 and "Host 'attacker.example' is not served here" in answer["error"]
    assert server.request("GET", "/health", headers={"Host": "localhost:8000"})[0] == 200
    assert server.request("GET", "/health", headers={"Host": "[::1]:8000"})[0] == 200
    body = json.dumps({"text": ["a"]}).encode()
    status, answer = server.request("POST", "/translate", body, {"Content-Type": "text/plain"})
    assert status == 415 and "application/json" in answer["error"]
    status, _ = server.request("OPTIONS", "/translate", headers={"Origin": "http://attacker.example"})
    assert status == 405  # no CORS preflight is granted
    assert "/health" not in json.dumps(health(server)) and "checkpoint" not in health(server)


def test_methods_and_query_strings_are_answered_as_http_expects(server):
    head = raw(server, b"HEAD /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")  # the headers, no body
    assert server.request("GET", "/health?x=1")[0] == 200
    for method in ("PUT", "DELETE", "GET"):
        status, answer = server.request(method, "/translate")
        assert status == 405 and "is not served" in answer["error"]
    status, answer = server.request("GET", "/nothing")
    assert status == 404 and "POST /translate" in answer["error"]


def test_metrics_in_the_prometheus_text_format(server):
    from prometheus_client.parser import text_string_to_metric_families

    assert server.translate({"text": LINES[0]})[0] == 200
    status, text = server.request("GET", "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    answered = {
        (s.labels["path"], s.labels["status"]): s.value
        for s in families["http_requests"].samples
        if s.name == "http_requests_total"
    }
    assert status == 200 and answered[("/translate", "200")] >= 1
    assert {"translate_seconds", "batch_requests", "queue_depth"} <= set(families)


def test_a_port_taken_and_an_open_host_without_allowed_hosts_are_one_line_errors():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, ROOT / "scripts" / "serve.py", f"checkpoint={CHECKPOINT}", f"port={port}"],
            capture_output=True,
            text=True,
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
    done = subprocess.run(
        [sys.executable, ROOT / "scripts" / "serve.py", f"checkpoint={CHECKPOINT}", "host=0.0.0.0"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "host=0.0.0.0 serves other machines" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_sigterm_drains_the_requests_in_flight_and_a_second_signal_stops_at_once():
    running = Running(*SLOW, "shutdown_timeout_s=8")
    answers = []
    asking = threading.Thread(
        target=lambda: answers.extend(together(running, [{"text": [line]} for line in LINES]))
    )
    asking.start()
    time.sleep(0.5)  # both queued, their batch waiting
    running.process.send_signal(signal.SIGTERM)
    asking.join(timeout=60)
    assert [status for status, _ in answers] == [200, 200]
    assert running.process.wait(timeout=30) == 0

    running = Running(*SLOW, "shutdown_timeout_s=30")
    outcome = []

    def ask() -> None:
        try:
            outcome.append(running.translate({"text": LINES})[0])
        except (OSError, http.client.HTTPException) as error:
            outcome.append(type(error).__name__)

    asking = threading.Thread(target=ask)
    asking.start()
    time.sleep(0.5)
    running.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    start = time.monotonic()
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=10) == 1
    assert time.monotonic() - start < 5
    asking.join(timeout=60)
    assert outcome == ["RemoteDisconnected"]  # its batch still waiting: dropped with the connection
    assert "Traceback" not in "".join(running.log) and "stopped at once" in "".join(running.log)


def test_the_published_contract_holds_under_fuzzing(server):
    """schemathesis draws requests from /openapi.json (bounded, no deadline) and sends them with a real
    client: no 5xx, every status documented, every body as its schema says (errors: {"error": str})."""
    import hypothesis
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(f"http://{server.host}:{server.port}/openapi.json")
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} == {"/translate", "/health"}
    for operation in operations:

        @hypothesis.settings(
            max_examples=25, deadline=None, database=None, suppress_health_check=list(hypothesis.HealthCheck)
        )
        @hypothesis.given(case=operation.as_strategy())
        def fuzz(case):
            response = case.call(
                headers={"Content-Type": "application/json"} if case.body is not None else None
            )
            case.validate_response(response, checks=checks)

        fuzz()
