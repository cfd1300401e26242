"""scripts/serve.py, the local HTTP endpoint, started as a user starts it and spoken to with a real
HTTP client on localhost: translations equal translate.py's, concurrent requests share one batch, bad
requests get a 4xx with a message and the server keeps serving, SIGTERM stops it; the server and an
interactive translate.py pack their weights once, not per batch."""

from __future__ import annotations

import http.client
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from transformer.config import SearchConfig, ServeConfig, TranslateConfig
from transformer.inference.translation import Translator
from transformer.kernels import onednn
from transformer.serving.api import request_cost
from transformer.serving.server import serve

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "tests" / "data" / "checkpoint_2b99159.pt"  # a small trained toy model
LINES = ["Today the dog sees the cat.", "The woman knows that the old man has seen the small bird."]


class Running:
    """A serve.py process and where it listens."""

    def __init__(self, *overrides: str) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "scripts" / "serve.py"),
                f"checkpoint={CHECKPOINT}",
                "port=0",
                *overrides,
            ],
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        said = ""  # the kernels' choice, then where it serves
        while not (found := re.search(r"on http://([\d.]+):(\d+)", said)):
            line = self.process.stderr.readline().decode()
            assert line, said + self.process.stderr.read().decode()
            said += line
        self.host, self.port = found.group(1), int(found.group(2))
        self.log = [said]  # what it says from then on, read as it comes (a full pipe would stall it)
        reading = (line.decode() for line in self.process.stderr)
        threading.Thread(target=lambda: self.log.extend(reading), daemon=True).start()

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        connection = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            payload = response.read()
            kind = response.getheader("Content-Type", "")
            return response.status, json.loads(payload) if kind.startswith("application/json") else payload
        finally:
            connection.close()

    def translate(self, payload: dict):
        return self.request(
            "POST", "/translate", json.dumps(payload).encode(), {"Content-Type": "application/json"}
        )


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    running = Running(
        "batch_wait_ms=1000", "max_lines=8", "max_chars=300", "max_body_bytes=20000", "device=cpu"
    )
    yield running
    running.process.kill()


def test_it_listens_on_localhost_and_translates_as_translate_does(server):
    assert server.host == "127.0.0.1"
    status, health = server.request("GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["step"] == 600
    status, answer = server.translate({"text": LINES, "nbest": 2, "beam_size": 5})
    assert status == 200
    expected = Translator.from_checkpoint(CHECKPOINT, device="cpu", nbest=2, beam_size=5).translate_nbest(
        LINES
    )
    for got, line, hypotheses in zip(answer["translations"], LINES, expected):
        assert got["source"] == line
        assert [h["text"] for h in got["hypotheses"]] == [h.text for h in hypotheses]
        assert [h["score"] for h in got["hypotheses"]] == pytest.approx(
            [h.score for h in hypotheses], abs=1e-5
        )
    status, one = server.translate({"text": LINES[0]})
    beam4 = Translator.from_checkpoint(CHECKPOINT, device="cpu").translate(LINES[:1])
    assert status == 200 and [one["translations"][0]["hypotheses"][0]["text"]] == beam4
    control = {"no_repeat_ngram_size": 1, "repetition_penalty": 1.5}
    status, controlled = server.translate({"text": LINES, **control})
    expected = Translator.from_checkpoint(CHECKPOINT, device="cpu", **control).translate(LINES)
    assert status == 200 and [t["hypotheses"][0]["text"] for t in controlled["translations"]] == expected


def test_a_requests_samples_do_not_depend_on_the_requests_it_is_batched_with(server):
    """Sampling's draws follow (seed, line number, sample, step): numbered within each request, the
    same request gives the same samples alone (as translate.py does) and batched with another."""
    sampling = {"sampling": True, "nbest": 2, "seed": 7, "topk": 20}
    (s0, a0), (s1, a1) = together(server, [{"text": [LINES[1]], **sampling}] * 2)
    assert s0 == s1 == 200 and a0["batch"] == a1["batch"]
    alone = Translator.from_checkpoint(CHECKPOINT, device="cpu", **sampling).translate_nbest(LINES[1:2])[0]
    for answer in (a0, a1):
        assert [h["text"] for h in answer["translations"][0]["hypotheses"]] == [h.text for h in alone]


def together(server: Running, payloads: list[dict]) -> list:
    """The answers to `payloads`, sent at the same moment from a thread each."""
    answers, barrier = [None] * len(payloads), threading.Barrier(len(payloads))

    def ask(i: int) -> None:
        barrier.wait()
        answers[i] = server.translate(payloads[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return answers


def test_two_concurrent_requests_share_one_batch(server):
    (s0, a0), (s1, a1) = together(server, [{"text": [LINES[0]]}, {"text": [LINES[1]]}])
    assert s0 == s1 == 200 and a0["batch"] == a1["batch"]
    alone = Translator.from_checkpoint(CHECKPOINT, device="cpu").translate(LINES)
    assert [
        a0["translations"][0]["hypotheses"][0]["text"],
        a1["translations"][0]["hypotheses"][0]["text"],
    ] == alone
    # other settings are not mixed into the batch: each gets its own search
    answers = together(server, [{"text": [LINES[0]]}, {"text": [LINES[0]], "beam_size": 1}])
    assert answers[0][1]["batch"] != answers[1][1]["batch"]


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "the body is not JSON"),
        (b"[1, 2]", 400, "the body must be a JSON object"),
        (json.dumps({"text": 5}).encode(), 400, '"text" must be a string or a list of strings'),
        (json.dumps({"text": ["a"], "beam_size": "4"}).encode(), 400, "beam_size='4' must be a whole number"),
        (json.dumps({"text": ["a"], "alpha": 50}).encode(), 400, "alpha=50.0 must be in [0, 10.0]"),
        (json.dumps({"text": ["a"], "alpha": 1e308}).encode(), 400, "alpha=1e+308 must be in [0, 10.0]"),
        (b'{"text": ["a"], "alpha": Infinity}', 400, "alpha=inf must be a finite number"),
        (json.dumps({"text": ["a"], "max_len_b": 10**6}).encode(), 400, "leave no room for a source"),
        (json.dumps({"text": ["a"], "beam": 4}).encode(), 400, "unknown field(s) beam"),
        (json.dumps({"text": ["a"], "nbest": 9}).encode(), 400, "nbest=9 must be at most beam_size=4"),
        (json.dumps({"text": ["a"] * 9}).encode(), 413, "9 lines; a request takes at most 8"),
        (json.dumps({"text": ["a" * 301]}).encode(), 413, "line 0 has 301 characters; at most 300"),
        (b"\xff\xfe", 400, "the body is not JSON"),
        (b"[" * 5000 + b"]" * 5000, 400, "nested too deeply"),
        (json.dumps({"text": ["a", "\ud800"]}).encode(), 400, "line 1 is not Unicode text"),
        (
            json.dumps({"text": ["a"], "sampling": True, "seed": 10**20}).encode(),
            400,
            "must be in 0..2^32 - 1",
        ),
        (json.dumps({"text": ["a"], "beam_size": 10**30}).encode(), 400, "must be in 1..1024"),
        (json.dumps({"text": ["a"], "repetition_penalty": 0}).encode(), 400, "repetition_penalty=0.0 must"),
    ],
)
def test_a_bad_request_gets_a_4xx_with_a_message_and_the_server_goes_on(server, body, status, message):
    got, answer = server.request("POST", "/translate", body, {"Content-Type": "application/json"})
    assert got == status and message in answer["error"]
    assert server.translate({"text": ["Today the dog sees the cat."]})[0] == 200


def test_an_oversized_body_an_unknown_path_and_attention(server):
    status, answer = server.request("POST", "/translate", b"x" * 20001, {"Content-Type": "application/json"})
    assert status == 413 and "at most 20000" in answer["error"]
    assert server.request("GET", "/nothing")[0] == 404 and server.request("POST", "/health", b"{}")[0] == 405
    status, answer = server.translate({"text": LINES[0], "attention": True})
    attention = answer["translations"][0]["hypotheses"][0]["attention"]
    assert status == 200 and attention["layers"] == [0, 1] and attention["heads"] == 4
    assert len(attention["cross"]) == 2 and len(attention["cross"][0]) == 4
    rows = attention["cross"][1][0]  # (target pieces, source pieces) in thousandths
    assert len(rows) == len(attention["target_pieces"]) and len(rows[0]) == len(attention["source_pieces"])
    assert all(abs(sum(row) - 1000) <= len(row) for row in rows)  # each row a distribution
    assert server.translate({"text": LINES[0], "attention": True, "attention_layer": 7})[0] == 400


def test_a_request_may_ask_for_each_hypothesis_alignment(server):
    status, answer = server.translate({"text": LINES, "nbest": 2, "alignment": True})
    expected = Translator.from_checkpoint(CHECKPOINT, device="cpu", nbest=2, alignment=True).translate_nbest(
        LINES
    )
    assert status == 200
    for got, hypotheses in zip(answer["translations"], expected):
        assert [h["alignment"] for h in got["hypotheses"]] == [
            [list(link) for link in h.alignment.words] for h in hypotheses
        ]
        assert [h["piece_alignment"] for h in got["hypotheses"]] == [
            [list(link) for link in h.alignment.pieces] for h in hypotheses
        ]
    status, plain = server.translate({"text": LINES[0]})
    assert status == 200 and "alignment" not in plain["translations"][0]["hypotheses"][0]
    status, contract = server.request("GET", "/openapi.json")
    schema = contract["paths"]["/translate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["properties"]["alignment"] == {"type": "boolean", "default": False}
    assert server.translate({"text": LINES[0], "alignment": "yes"})[0] == 400


def test_a_requests_cost_counts_the_output_a_target_prefix_forces_and_the_alignment_pass():
    """Source pieces x rows x output limit: a |X| + b = 52 for 2 pieces, or the prefix's 1,000 + EOS,
    then + the constraints' pieces."""
    assert request_cost([[5, 3]], SearchConfig(), attention=False) == 2 * 4 * 52
    assert request_cost([[5, 3]], SearchConfig(), attention=False, grown=[(1000, 0)]) == 2 * 4 * 1001
    assert request_cost([[5, 3]], SearchConfig(), attention=False, grown=[(1000, 7)]) == 2 * 4 * 1008
    assert request_cost([[5, 3]], SearchConfig(nbest=3, alignment=True), attention=False) == 2 * 4 * 52 * 3


def test_a_target_prefix_per_line_starts_each_translation(server):
    prefixes = ["Heute", "Die Mutter"]
    status, answer = server.translate({"text": LINES, "target_prefix": prefixes, "nbest": 2})
    expected = Translator.from_checkpoint(CHECKPOINT, device="cpu", nbest=2).translate_nbest(
        LINES, target_prefix=prefixes
    )
    got = [[h["text"] for h in t["hypotheses"]] for t in answer["translations"]]
    assert status == 200 and got == [[h.text for h in hs] for hs in expected]
    assert all(text.startswith(prefix) for prefix, texts in zip(prefixes, got) for text in texts)
    status, refused = server.translate({"text": LINES, "target_prefix": ["Heute"]})
    assert status == 400 and '2 lines but 1 in "target_prefix"' in refused["error"]


def test_a_line_longer_than_the_model_takes_is_translated_in_parts(server):
    """With outputs of up to 20 x |X| + 50 the model takes 47 pieces: a line of four sentences (about 75)
    is translated sentence by sentence and joined, as translate.py does; its attention, of no one source,
    is null."""
    room, line = {"max_len_a": 20.0, "max_len_b": 50}, " ".join(LINES * 2)
    status, answer = server.translate({"text": [line, LINES[0]], "attention": True, **room})
    expected = Translator.from_checkpoint(CHECKPOINT, device="cpu", **room).translate([line, LINES[0]])
    (split, whole) = [t["hypotheses"][0] for t in answer["translations"]]
    assert status == 200 and [split["text"], whole["text"]] == expected
    assert split["pieces"].count("</s>") == 4 and split["attention"] is None and whole["attention"]


def test_sigterm_stops_it_cleanly():
    running = Running("device=cpu")
    assert running.request("GET", "/health")[0] == 200
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=30) == 0


@pytest.fixture
def packings(monkeypatch) -> list[int]:
    """Every weight packed for the CPU's products (`Products.prepacked`), counted."""
    counted: list[int] = []

    class Counted(onednn._Packed):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            counted.append(1)

    monkeypatch.setattr(onednn, "_Packed", Counted)
    return counted


def test_the_weights_are_packed_once_for_the_servers_life(packings, caplog):
    """serve() in this process, spoken to by a client thread that stops it with SIGTERM: the batches of
    three requests reuse the weights packed when it started."""
    cfg = ServeConfig(checkpoint=str(CHECKPOINT), port=0, device="cpu", cpu_kernels="on", batch_wait_ms=0)
    ready, answers, at_start = threading.Event(), [], []

    def client() -> None:
        ready.wait(120)
        at_start.append(len(packings))
        host, port = re.search(r"on http://([\d.]+):(\d+)", caplog.text).groups()
        for line in LINES + LINES[:1]:
            connection = http.client.HTTPConnection(host, int(port), timeout=120)
            connection.request(
                "POST", "/translate", json.dumps({"text": line}), {"Content-Type": "application/json"}
            )
            answers.append(connection.getresponse().status)
            connection.close()
        os.kill(os.getpid(), signal.SIGTERM)

    asking = threading.Thread(target=client)
    asking.start()
    with caplog.at_level("WARNING"):
        serve(cfg, ready)
    asking.join(timeout=120)
    assert answers == [200, 200, 200] and at_start[0] > 0 and len(packings) == at_start[0]


def test_an_interactive_translate_session_packs_the_weights_once(packings, monkeypatch, tmp_path):
    """translate.py answering a pipe line by line (buffer_size=1) packs its weights once, not per line."""
    spec = importlib.util.spec_from_file_location("translate_cli", ROOT / "translate.py")
    translate_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(translate_cli)
    counts = []
    for lines in (LINES[:1], LINES + LINES):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(lines).encode() + b"\n")))
        out = tmp_path / f"{len(lines)}.txt"
        config = dict(
            checkpoint=str(CHECKPOINT), device="cpu", cpu_kernels="on", buffer_size=1, output=str(out)
        )
        translate_cli.run(TranslateConfig(**config))
        assert len(out.read_text().splitlines()) == len(lines)
        counts.append(len(packings))
    assert counts[0] > 0 and counts[1] == 2 * counts[0]  # one packing per session


def test_constraints_per_line_are_in_every_translation(server):
    phrases = [["Katze"], ["Vogel", "Frau"]]
    status, answer = server.translate({"text": LINES, "constraints": phrases, "nbest": 2})
    assert status == 200, answer
    expected = Translator.from_checkpoint(CHECKPOINT, device="cpu", nbest=2).translate_nbest(
        LINES, constraints=phrases
    )
    got = [[h["text"] for h in t["hypotheses"]] for t in answer["translations"]]
    assert status == 200 and got == [[h.text for h in hs] for hs in expected]
    assert all(all(p in text for p in wanted) for wanted, texts in zip(phrases, got) for text in texts)
    status, one = server.translate({"text": LINES[0], "constraints": ["Katze"]})
    assert status == 200 and "Katze" in one["translations"][0]["hypotheses"][0]["text"]
    status, refused = server.translate({"text": LINES, "constraints": [["Katze"]]})
    assert status == 400 and '2 lines but 1 in "constraints"' in refused["error"]
    status, refused = server.translate({"text": LINES[0], "constraints": ["Katze"], "sampling": True})
    assert status == 400 and "constraints shape a search: not with sampling=true" in refused["error"]
    status, refused = server.translate({"text": LINES, "constraints": "Katze"})
    assert status == 400 and '"constraints" must be a list of phrases per line' in refused["error"]
