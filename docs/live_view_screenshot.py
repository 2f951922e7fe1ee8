"""The README's picture of the live view: `specdecode serve` on the default models, the page in headless Chromium,
one prompt answered with `auto` and compared with plain decoding, the page saved as a PNG.

    python docs/live_view_screenshot.py --out docs/live-view.png
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
import urllib.request

from playwright.sync_api import sync_playwright

PROMPT = "Write a Python function that checks whether a string is a palindrome."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/live-view.png")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--port", str(args.port)])
    try:
        for _ in range(600):  # the first start assembles and converts the default models
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        with sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=shutil.which("chromium"),
                                             args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.goto(f"http://127.0.0.1:{args.port}/")
            page.wait_for_function("document.getElementById('status').textContent === 'Ready.'")
            page.fill("#max-tokens", "160")
            page.fill("#prompt", PROMPT)
            page.click("#send")
            page.wait_for_function("document.getElementById('status').textContent === 'Done.'", timeout=600_000)
            page.click("#compare")
            page.wait_for_function("document.getElementById('comparison').textContent.includes('speedup')",
                                   timeout=600_000)
            page.click("#answer span.draft")
            page.screenshot(path=args.out, full_page=True)
            print(page.inner_text("#stats"))
            print(page.inner_text("#comparison"))
            browser.close()
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
