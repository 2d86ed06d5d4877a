"""The budget explorer served by Voilà and driven in a real headless Chromium (part of make test; marked ``ui``).

Skipped where Debian's chromium is missing (``apt-get install -y chromium``; make test installs it when it can);
every request that leaves the loopback interface is aborted, so the test runs offline. Drives every control a
deployment decision needs: limits, budgets, a second budget set, a latency table path, a trace upload, Recommend
and the vLLM export. Saves test-output/explorer.png for a human to look at.
"""
import json
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
MIXED = "mixed-large: 224²–1344² images, 1–4 per request"
TRACE_CSV = "request,height,width,frames\nr1,1080,1920,1\nr1,720,1280,16\nr2,224,224,1\n"
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


def synthetic_table(path: Path) -> Path:
    """A latency table made up for this test only (P99 columns and capture times included)."""
    rows = [{"tokens": t, "graph_ms": 1.0 + 0.004 * t, "eager_ms": 6.0 + 0.005 * t, "graph_p99_ms": 2.0 + 0.004 * t,
             "eager_p99_ms": 9.0 + 0.005 * t} for t in (64, 256, 1024, 4096)]
    path.write_text(json.dumps({"provenance": {"source": "synthetic test table"}, "budgets": rows,
                                "capture": {"64": {"seconds": 0.5}, "4096": {"seconds": 2.5}}}))
    return path


def submit(field, text: str) -> None:
    field.fill(text)
    field.press("Enter")


def test_explorer_renders_and_responds(voila_url, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    table = synthetic_table(tmp_path / "my_gpu.json")
    trace = tmp_path / "traffic.csv"
    trace.write_text(TRACE_CSV)
    export = tmp_path / "vllm.json"

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1400})
            page.route("**/*", loopback_only)
            page.goto(voila_url, wait_until="commit")
            summary = page.locator(".glmvit-summary")
            expect(summary).to_contain_text("padding waste", timeout=90_000)
            expect(summary).to_contain_text("64 items, 64 segments")
            expect(summary).to_contain_text("P99")  # the H200 table is the default

            page.locator(".widget-slider", has_text="max items").locator(".noUi-handle").focus()
            page.keyboard.press("ArrowLeft")
            expect(summary).to_contain_text("63 items, 64 segments", timeout=30_000)

            budgets = page.get_by_placeholder("64, 256, 1024 or auto")
            submit(budgets, "64, abc")
            expect(page.locator(".glmvit-error")).to_contain_text("is not an integer", timeout=30_000)

            page.locator("select").select_option(label=MIXED)
            submit(budgets, "256, 1024, 4096")
            expect(summary).to_contain_text("256, 1024, 4096", timeout=30_000)
            expect(page.locator(".glmvit-error")).to_have_count(0)

            submit(page.get_by_placeholder("second budget set (empty: none)"), "64, 512")
            expect(summary).to_contain_text("budget set B", timeout=30_000)
            expect(summary).to_contain_text("64, 512")

            submit(page.get_by_placeholder("python -m glmvit latency --json PATH"), str(table))
            expect(page.locator(".glmvit-note")).to_contain_text("my_gpu.json", timeout=30_000)
            expect(summary).to_contain_text("every batch at its P99 latency")

            with page.expect_file_chooser() as chooser:  # ipywidgets' upload button opens a detached file input
                page.locator(".widget-upload").click()
            chooser.value.set_files(str(trace))
            expect(summary).to_contain_text("2 requests, 3 items", timeout=30_000)
            expect(page.locator("select")).to_contain_text("traffic.csv")

            before = summary.inner_text()
            page.get_by_role("button", name="Recommend").click()
            expect(page.locator(".glmvit-info").first).to_contain_text("recommended", timeout=60_000)
            expect(summary).not_to_contain_text("256, 1024, 4096", timeout=30_000)
            assert summary.inner_text() != before

            expect(page.locator(".glmvit-export")).to_contain_text("encoder_cudagraph_token_budgets")
            page.locator(".widget-text", has_text="export to").locator("input").fill(str(export))
            page.get_by_role("button", name="Export vLLM config").click()
            expect(page.locator(".glmvit-info").first).to_contain_text("wrote", timeout=30_000)
            assert json.loads(export.read_text())["cudagraph_mm_encoder"] is True

            out = ROOT / "test-output"
            out.mkdir(exist_ok=True)
            page.screenshot(path=str(out / "explorer.png"), full_page=True)
        finally:
            browser.close()
