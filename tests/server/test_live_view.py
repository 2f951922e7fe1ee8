"""The live view at / in a real browser: headless Chromium (Debian's package) driven by Playwright's Python API.
Skipped, saying why, where neither is installed (.ci/run installs both)."""

from __future__ import annotations

import shutil

import pytest
from test_server import MODEL, SETTINGS, models, running  # noqa: F401 - fixture

from specdecode import Engine
from specdecode.server.app import create_app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="Playwright's Python package is not installed")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (Debian: apt-get install "
                                "chromium)")
BROWSER_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync"]


@pytest.fixture(scope="module")
def page(models):
    engine = Engine(*models, SETTINGS.spec)
    with running(create_app(engine, SETTINGS)) as server, playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=BROWSER_FLAGS)
        view = browser.new_page(viewport={"width": 390, "height": 844})  # a phone's width
        view.goto(f"http://127.0.0.1:{server.port}/")
        view.wait_for_function("document.getElementById('status').textContent === 'Ready.'")
        yield view
        browser.close()


def send_and_wait(page) -> None:
    """Send the form's prompt and wait for its answer to end."""
    page.click("#send")
    page.wait_for_function("document.getElementById('status').textContent === 'Done.'", timeout=60_000)


def test_a_prompt_streams_coloured_tokens_with_their_steps_and_compares_with_plain_decoding(page):
    methods = page.eval_on_selector_all("#method option", "options => options.map(o => o.value)")
    assert {"", "none", "ngram", "suffix", "draft", "recycle", "auto"} <= set(methods)  # from the registry
    page.select_option("#method", "ngram")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    page.fill("#prompt", "hello hello hello hello")
    send_and_wait(page)
    kinds = page.eval_on_selector_all("#answer span", "spans => spans.map(s => s.className)")
    assert len(kinds) == 24 and any(k.startswith("draft") for k in kinds) and "target" in kinds
    titles = page.eval_on_selector_all("#answer span.draft", "spans => spans.map(s => s.title)")
    assert all("draft position" in t and "accepted" in t for t in titles)
    assert "tokens/s" in page.inner_text("#stats") and "accepted by position" in page.inner_text("#stats")
    page.click("#answer span.draft")
    assert "step" in page.inner_text("#step-detail")
    page.click("#compare")
    page.wait_for_function("document.getElementById('comparison').textContent.includes('speedup')", timeout=60_000)
    assert "identical text" in page.inner_text("#comparison")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the phone


def test_a_tree_method_shows_its_last_tree(page):
    page.select_option("#method", "suffix")
    page.fill("#max-tokens", "48")
    page.fill("#prompt", "abc abc abc abd abd abc")
    page.eval_on_selector("input[data-option='suffix_tree_nodes']", "input => { input.value = '8'; }")
    send_and_wait(page)
    assert page.is_visible("#tree") and "last tree" in page.inner_text("#tree")
