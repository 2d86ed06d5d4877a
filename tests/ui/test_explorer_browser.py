"""The budget explorer served by Voilà and driven in a real headless Chromium (opt-in: ``pytest -m ui``).

Needs Debian's chromium at /usr/bin/chromium (``apt-get install -y chromium``); every request that leaves the
loopback interface is aborted, so the test runs offline. Saves test-output/explorer.png for a human to look at.
"""
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytestmark = pytest.mark.ui

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-quic", "--no-first-run"]
MIXED = "mixed 224²–1344², 1–4 per request"
LOOPBACK = {"127.0.0.1", "localhost"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"voila exited with code {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"voila did not listen on port {port} within {timeout} s")


@pytest.fixture
def voila_url(tmp_path):
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)")
    voila = Path(sys.executable).parent / "voila"
    port = free_port()
    log = open(tmp_path / "voila.log", "w")
    proc = subprocess.Popen([str(voila), "notebooks/explorer.ipynb", "--no-browser", f"--port={port}",
                             "--Voila.ip=127.0.0.1"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, proc)
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def loopback_only(route):
    if urlparse(route.request.url).hostname in LOOPBACK:
        route.continue_()
    else:
        route.abort()


def test_explorer_renders_and_responds(voila_url):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1400})
            page.route("**/*", loopback_only)
            page.goto(voila_url, wait_until="commit")
            summary = page.locator(".glmvit-summary")
            expect(summary).to_contain_text("padding waste", timeout=90_000)
            expect(summary).to_contain_text("64 items, 64 segments")

            page.locator(".widget-slider", has_text="max items").locator(".noUi-handle").focus()
            page.keyboard.press("ArrowLeft")
            expect(summary).to_contain_text("63 items, 64 segments", timeout=30_000)

            budgets = page.get_by_placeholder("64, 256, 1024 or auto")
            budgets.fill("64, abc")
            budgets.press("Enter")
            expect(page.locator(".glmvit-error")).to_contain_text("is not an integer", timeout=30_000)

            page.locator("select").select_option(label=MIXED)
            budgets.fill("256, 1024, 4096")
            budgets.press("Enter")
            expect(summary).to_contain_text("256, 1024, 4096", timeout=30_000)
            expect(page.locator(".glmvit-error")).to_have_count(0)
            before = summary.inner_text()

            page.get_by_role("button", name="Recommend").click()
            expect(page.locator(".glmvit-info")).to_contain_text("recommended", timeout=60_000)
            expect(summary).not_to_contain_text("256, 1024, 4096", timeout=30_000)
            assert summary.inner_text() != before

            out = ROOT / "test-output"
            out.mkdir(exist_ok=True)
            page.screenshot(path=str(out / "explorer.png"), full_page=True)
        finally:
            browser.close()
