"""The attention explorer (GET / of scripts/serve.py) in a real headless browser: Debian's Chromium driven
by Playwright types a sentence, waits for the translation and the drawing, and the page is checked
against the endpoint's own JSON (the hypotheses, the pieces and heads drawn, one head's weights, another
layer fetched on demand, the hard alignment's cells); bad input shows a message, never a blank page.

The browser: `apt-get install chromium` (CI installs it; elsewhere the test skips without it)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_serve import Running

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):
        pytest.fail("CI needs Debian's chromium for the explorer's browser test", pytrace=False)
    pytest.skip("no chromium: apt-get install chromium", allow_module_level=True)

# a headless Chromium that opens no connection of its own (the machine's network is closed)
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SENTENCE = "Today the dog sees the cat."


@pytest.fixture(scope="module")
def server():
    running = Running("device=cpu", "max_chars=6000", "max_request_cost=5000000")  # a long paste drawn
    yield running
    running.process.kill()


@pytest.fixture(scope="module")
def page(server):
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page()
        page.goto(f"http://{server.host}:{server.port}/")
        yield page
        browser.close()


def endpoint(server, text: str, layer: int, nbest: int = 2) -> dict:
    status, answer = server.translate(
        {"text": [text], "nbest": nbest, "beam_size": 4, "attention": True, "attention_layer": layer}
    )
    assert status == 200
    return answer["translations"][0]


def translate_in_page(page, text: str, nbest: int = 2, wait: bool = True) -> None:
    """Type, click, and (wait) until this translation is shown: the click hides the last one at once."""
    page.fill("#text", text)
    page.select_option("#nbest", str(nbest))
    # the page's first view, whatever an earlier test chose (the controls may be hidden now)
    page.evaluate(
        "document.getElementById('kind').value = 'cross'; document.getElementById('style').value = 'lines'"
    )
    page.click("#go")
    if wait:
        page.wait_for_selector("#result:not([hidden])", timeout=120_000)


def drawn(page) -> list[dict]:
    return page.eval_on_selector_all(
        "line.weight",
        "ls => ls.map(l => ({head: +l.dataset.head, q: +l.dataset.q, k: +l.dataset.k, w: +l.dataset.w}))",
    )


def test_the_page_draws_the_endpoints_translation_and_attention(page, server):
    translate_in_page(page, SENTENCE)
    expected = endpoint(server, SENTENCE, -1)
    hypotheses = page.locator("#hypotheses li").all_inner_texts()
    assert [h.split(" (score")[0] for h in hypotheses] == [h["text"] for h in expected["hypotheses"]]
    attention = expected["hypotheses"][0]["attention"]  # cross attention of the last layer, every head
    assert page.locator("text.piece.query").all_text_contents() == attention["target_pieces"]
    assert page.locator("text.piece.key").all_text_contents() == attention["source_pieces"]
    assert page.locator("#legend span").count() == attention["heads"] == 4
    lines = drawn(page)
    assert {line["head"] for line in lines} == set(range(4))
    page.select_option("#head", value="1")  # one head: exactly its weights of at least 0.005
    cross = attention["cross"][0][1]  # (queries, keys)
    shown = {(line["q"], line["k"]): line["w"] for line in drawn(page)}
    assert {line["head"] for line in drawn(page)} == {1}
    assert shown == {(q, k): w for q, row in enumerate(cross) for k, w in enumerate(row) if w >= 5}


def test_another_layer_kind_and_hypothesis_are_drawn_from_their_own_weights(page, server):
    translate_in_page(page, SENTENCE)
    page.select_option("#layer", value="0")  # fetched on demand
    page.select_option("#kind", "encoder_self")
    page.select_option("#head", value="0")
    page.wait_for_function(
        "document.querySelectorAll('line.weight').length > 0 && !document.getElementById('result').hidden"
    )
    weights = endpoint(server, SENTENCE, 0)["hypotheses"][0]["attention"]["encoder_self"][0][0]
    shown = {(line["q"], line["k"]): line["w"] for line in drawn(page)}
    assert shown == {(q, k): w for q, row in enumerate(weights) for k, w in enumerate(row) if w >= 5}
    page.click("#hypotheses li:nth-child(2)")  # the second hypothesis: its own target pieces
    page.select_option("#kind", "decoder_self")
    second = endpoint(server, SENTENCE, 0)["hypotheses"][1]["attention"]
    assert page.locator("text.piece.query").all_text_contents() == second["target_pieces"]
    page.hover("text.piece.query >> nth=2")  # hovering a piece keeps only its lines
    faded = page.eval_on_selector_all(
        "line.weight", "ls => ls.map(l => [+l.dataset.q, l.classList.contains('faded')])"
    )
    assert all(is_faded == (q != 2) for q, is_faded in faded) and any(not f for _, f in faded)
    page.select_option("#style", "heatmap")
    cells = page.locator("rect.weight").count()
    assert cells == len(second["target_pieces"]) ** 2


def test_the_hard_alignment_marks_each_rows_strongest_cell_on_the_cross_attention_heatmap(page, server):
    translate_in_page(page, SENTENCE)
    page.select_option("#style", "heatmap")  # the last layer's encoder-decoder attention, heads averaged
    assert page.locator("rect.link").count() == 0  # marked when asked
    page.check("#alignment")
    status, answer = server.translate({"text": [SENTENCE], "nbest": 2, "beam_size": 4, "alignment": True})
    links = answer["translations"][0]["hypotheses"][0]["piece_alignment"]  # [source piece, target piece]
    marks = page.eval_on_selector_all("rect.link", "rs => rs.map(r => [+r.dataset.k, +r.dataset.q])")
    assert status == 200 and marks and sorted(marks) == sorted(links)
    cells = page.eval_on_selector_all(
        "rect.weight", "rs => rs.map(r => [+r.dataset.q, +r.dataset.k, +r.dataset.w])"
    )
    shown = {(q, k): w for q, k, w in cells}
    keys = max(k for _, k in shown)  # the last key is EOS, never linked
    for k, q in marks:  # drawn in thousandths, so a tie may round either way
        assert shown[q, k] >= max(shown[q, other] for other in range(keys)) - 1
    page.select_option("#kind", "encoder_self")
    assert page.locator("rect.link").count() == 0 and page.locator("#alignment").is_disabled()


@pytest.mark.parametrize(
    "text, shown",
    [
        ("", "The text is empty: type a sentence to translate."),
        ("   ", "The text is empty: type a sentence to translate."),
        ("x" * 7000, "line 0 has 7000 characters; at most 6000 (max_chars)"),  # the server's own message
    ],
    ids=["empty", "blank", "too long"],
)
def test_bad_input_shows_a_message_never_a_blank(page, text, shown):
    translate_in_page(page, text, nbest=1, wait=False)
    page.wait_for_function(f"document.getElementById('message').textContent === {json.dumps(shown)}")
    assert page.locator("#result").is_hidden()


@pytest.mark.parametrize(
    "text",
    ["😀 The dog 🐕 sees the cat.", "שלום עולם, the dog sees the cat", "the dog " * 700],
    ids=["emoji", "right-to-left", "5,600 characters"],
)
def test_emoji_right_to_left_and_a_long_paste_are_translated_and_drawn(page, text):
    translate_in_page(page, text, nbest=1)
    assert page.locator("#hypotheses li").count() == 1 and page.locator("#message").inner_text() == ""
    if len(text) > 1000:  # drawn for a window of the pieces, with a note saying so
        assert "the first 64 of each are shown" in page.locator("#note").inner_text()
        assert page.locator("text.piece.key").count() == 64


def test_the_page_is_the_packages_and_fetches_nothing_from_elsewhere(server):
    status, html = server.request("GET", "/")
    assert (
        status == 200 and b"/explorer.js" in html and b"http" not in html.replace(b"http://www.w3.org", b"")
    )
    for path in ("/explorer.js", "/explorer.css"):
        status, body = server.request("GET", path)
        assert status == 200 and b"https://" not in body
