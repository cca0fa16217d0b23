"""The playground at ``/``, in a real browser: Debian's Chromium driven by Playwright, against
``foretell serve`` on the tiny model (and, for the key prompt, a keyed server in process).
The ``report_origins`` stream extension the page draws is tests/proxy/server/test_report_origins.py.

The browser is the system's (``/usr/bin/chromium``, or ``FORETELL_CHROMIUM``); ``scripts/test.sh``
installs Debian's ``chromium`` package when it is missing. Without it these tests fail with a
message saying so: they are never skipped."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from foretell.sdk.edit import build_edit_prompt, extract_edited_text
from harness.live_server import live_server
from tests.helpers import GREEDY_PROMPT, GREEDY_TOKENS
from tests.serving import serve, tiny_app

CHROMIUM = os.environ.get("FORETELL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
KEY = "sk-playground-test"
PROMPT, TOKENS = GREEDY_PROMPT, GREEDY_TOKENS  # the greedy fixture's request
WAIT_MS = 240_000


# ---- servers and the browser -------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_folder, stub_upstream):
    """The tiny model as "tiny", and "up-ok" routed to the session's stub upstream."""
    folder = tmp_path_factory.mktemp("playground")
    config = folder / "foretell.toml"
    config.write_text(f'[upstreams.stub]\nbase_url = "{stub_upstream.base_url}"\nmax_retries = 0\n\n'
                      '[models.up-ok]\nupstream = "stub"\n')
    with live_server(tiny_model_folder, folder / "serve.log", "--served-model-name", "tiny",
                     "--config", str(config)) as server:
        yield server


@pytest.fixture(scope="module")
def keyed(tiny_model_folder):
    """A server that asks for a key (``--api-key``), in this process: the page's key handling."""
    with serve(tiny_app(tiny_model_folder, api_keys=(KEY,)), "playground-keyed") as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"the browser tests need Chromium at {CHROMIUM}: install Debian's chromium "
                    "package (scripts/test.sh does, as root) or set FORETELL_CHROMIUM", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the browser tests need playwright: pip install -e '.[dev]'", pytrace=False)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Page:
    """A fresh tab on a server's playground, recording what its console says."""

    def __init__(self, browser, base: str):
        self.context = browser.new_context(viewport={"width": 1360, "height": 900})
        self.page = self.context.new_page()
        self.page.set_default_timeout(WAIT_MS)
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))
        self.page.goto(base + "/")
        self.page.wait_for_selector("body[data-ready=true]")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser, served):
    tab = Page(browser, served.base)
    yield tab
    tab.close()


def run_prompt(tab: Page, prompt: str, prediction: str, max_tokens: int) -> None:
    page = tab.page
    page.click("#mode-prompt")
    page.fill("#prompt-text", prompt)
    page.fill("#prediction-text", prediction)
    page.fill("#max-tokens", str(max_tokens))
    page.click("#send")
    page.wait_for_selector("#answer[data-chunks]")


def answer_spans(page) -> list[tuple[str, str]]:
    return page.eval_on_selector_all(
        "#answer span", "spans => spans.map(s => [s.className, s.textContent])")


# ---- the page --------------------------------------------------------------------------------

def test_the_page_is_served_with_a_strict_policy(served):
    response = httpx.get(served.base + "/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    for path, media_type in [("/static/playground.js", "text/javascript"), ("/static/playground.css", "text/css")]:
        asset = httpx.get(served.base + path)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(media_type)
        assert asset.text.strip()
    # Nothing is fetched from elsewhere: every reference in the page is to this server.
    assert "http://" not in response.text and "https://" not in response.text


def test_the_page_loads_without_console_errors_and_lists_the_models(page):
    options = page.page.eval_on_selector_all("#model option", "options => options.map(o => o.value)")
    assert options == ["tiny", "up-ok"]  # the local model first, then the upstream routes
    assert page.page.inner_text("#health") == "ready"
    assert page.page.is_hidden("#key-panel") and page.page.is_hidden("#error")
    assert page.errors == []


def test_a_request_streams_with_origin_colours_and_the_comparison_completes(page, greedy):
    run_prompt(page, PROMPT, greedy, TOKENS)
    spans = answer_spans(page.page)
    assert "".join(text for _, text in spans) == greedy
    assert int(page.page.get_attribute("#answer", "data-chunks")) >= 1
    predicted = "".join(text for cls, text in spans if cls == "o-prediction")
    assert len(predicted) > len(greedy) / 2, spans  # most of the answer came from the prediction
    assert any(cls == "o-target" for cls, _ in spans)  # the target's own tokens (each pass adds one)
    colours = page.page.eval_on_selector_all(
        "#answer span", "spans => spans.map(s => [s.className, getComputedStyle(s).backgroundColor])")
    assert {c for cls, c in colours if cls == "o-prediction"}.isdisjoint(
        {c for cls, c in colours if cls == "o-target"})  # the colours differ
    assert page.page.inner_text("#stat-tokens") == str(TOKENS)
    passes = int(page.page.inner_text("#stat-passes"))
    assert 1 <= passes < TOKENS  # speculation saved passes
    accepted, rejected = (int(n) for n in page.page.inner_text("#stat-prediction").split("/"))
    assert accepted > 0 and rejected == 0
    assert float(page.page.inner_text("#stat-speed")) > 0
    assert "prediction:" in page.page.inner_text("#sources")

    page.page.click("#view-diff")
    assert "no changes" in page.page.inner_text("#diff")
    page.page.click("#view-answer")

    page.page.click("#compare")
    page.page.wait_for_selector("#comparison:not([hidden])")
    summary = page.page.inner_text("#comparison-summary")
    assert "with speculation" in summary and "the same text" in summary
    plain = page.page.eval_on_selector_all("#row-plain td", "cells => cells.map(c => c.textContent)")
    assert plain[1] == str(TOKENS) and int(plain[2]) == TOKENS  # one pass per token without it
    assert int(page.page.get_attribute("#comparison", "data-chunks")) >= TOKENS // 2  # it streamed
    assert page.errors == []


def test_a_changed_answer_shows_in_the_diff(page, greedy):
    prediction = greedy[: len(greedy) // 2] + "\nsomething else entirely\n"
    run_prompt(page, PROMPT, prediction, TOKENS)
    page.page.click("#view-diff")
    diff = page.page.inner_text("#diff")
    assert "lines" in diff and page.page.locator("#diff .del").count() >= 1
    assert page.page.locator("#diff .add").count() >= 1
    assert page.errors == []


def test_an_upstream_route_streams_without_colours(page):
    page.page.select_option("#model", "up-ok")
    run_prompt(page, PROMPT, "", 8)
    assert page.page.inner_text("#answer") == "Hello from upstream"
    assert {cls for cls, _ in answer_spans(page.page)} == {"o-unknown"}  # no origins to colour by
    assert "did not report token origins" in page.page.inner_text("#note")
    assert page.errors == []


def test_edit_mode_sends_the_sdk_edit_prompt(page):
    text = "def area(w, h):\n    return w * h\n"
    sent = []
    page.page.on("request", lambda r: sent.append(r) if r.url.endswith("/v1/chat/completions") else None)
    page.page.fill("#filename", "shapes.py")
    page.page.fill("#file-text", text)
    page.page.fill("#instruction", "Rename w to width.")
    page.page.fill("#max-tokens", "6")
    page.page.click("#send")
    page.page.wait_for_selector("#answer[data-chunks]")
    body = json.loads(sent[0].post_data)
    expected = build_edit_prompt(text, "Rename w to width.", filename="shapes.py")
    assert body["messages"] == expected.messages
    assert body["prediction"] == {"type": "content", "content": expected.prediction}
    assert body["stop"] == expected.stop and body["max_tokens"] == 6
    assert body["speculation"] == {"prompt_lookup": True, "report_origins": True}
    assert page.page.locator("#answer span").count() >= 1
    assert page.errors == []


@pytest.mark.parametrize("text, instruction, filename", [
    ("x = 1\n", "Add y.", "a.py"),
    ("no final newline", "  Keep it.  ", "notes.MD"),
    ("", "Write something.", None),
    ("```js\ncode\n```\n````\n", "Fences inside.", "README.md"),
    ("é 𝔘 漢字\n", "Unicode.", ".hidden.toml"),
    ("a\n", "Unknown extension.", "dir/file.weird"),
])
def test_the_pages_edit_prompt_is_the_sdks(page, text, instruction, filename):
    got = page.page.evaluate("([t, i, f]) => window.foretellPlayground.buildEditPrompt(t, i, f)",
                             [text, instruction, filename])
    expected = build_edit_prompt(text, instruction, filename=filename)
    assert got == {"messages": expected.messages, "prediction": expected.prediction, "fence": expected.fence,
                   "max_tokens": expected.max_tokens, "stop": expected.stop}


@pytest.mark.parametrize("output, keep", [
    ("```python\nx = 2\n```\nmore", True), ("```python\nx = 2\n```", False), ("no fence\n\n", True),
    ("```python\ncut off", True), ("  ```\nindented\n  ```\n", True),
])
def test_the_pages_extraction_is_the_sdks(page, output, keep):
    got = page.page.evaluate("([o, k]) => window.foretellPlayground.extractEditedText(o, '```', k)", [output, keep])
    assert got == extract_edited_text(output, "```", "stop", keep_final_newline=keep)[0]


def test_a_bad_key_shows_the_error_and_the_right_one_works(browser, keyed):
    tab = Page(browser, keyed.base)
    try:
        page = tab.page
        assert page.is_visible("#key-panel")
        assert "needs an API key" in page.inner_text("#error")
        page.fill("#key-input", "sk-wrong")
        page.click("#key-form button")
        page.wait_for_selector("#error:has-text('invalid API key')")
        assert page.is_visible("#key-panel") and page.locator("#model option").count() == 0
        page.fill("#key-input", KEY)
        page.click("#key-form button")
        page.wait_for_selector("#key-panel", state="hidden")
        assert page.eval_on_selector_all("#model option", "o => o.map(x => x.value)") == ["tiny"]
        # The key lives in this tab's sessionStorage only.
        assert page.evaluate("sessionStorage.getItem('foretell-api-key')") == KEY
        assert page.evaluate("localStorage.length") == 0 and tab.context.cookies() == []
        # A request with a key that stopped working shows the error too.
        page.evaluate("sessionStorage.setItem('foretell-api-key', 'sk-revoked')")
        page.click("#mode-prompt")
        page.fill("#prompt-text", PROMPT)
        page.fill("#max-tokens", "4")
        page.click("#send")
        page.wait_for_selector("#error:has-text('invalid API key')")
        assert page.is_visible("#key-panel")
        # Only the refused requests were errors.
        assert tab.errors and all("401" in error for error in tab.errors), tab.errors
    finally:
        tab.close()
    other = Page(browser, keyed.base)  # another tab does not have the key
    try:
        assert other.page.is_visible("#key-panel")
    finally:
        other.close()


def test_screenshot(page, greedy, tmp_path):
    """A picture of the page after a streamed run and its comparison, for a reviewer."""
    run_prompt(page, PROMPT, greedy, TOKENS)
    page.page.click("#compare")
    page.page.wait_for_selector("#comparison:not([hidden])")
    path = tmp_path / "playground.png"
    page.page.screenshot(path=str(path), full_page=True)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000
    print(f"playground screenshot: {path}")
