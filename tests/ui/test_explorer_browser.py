"""The budget explorer served as ``make explorer`` serves it (Voilà behind a token) and driven in a real headless
Chromium (part of make test; marked ``ui``).

Skipped where Debian's chromium is missing (``apt-get install -y chromium``; make test installs it when it can);
every request that leaves the loopback interface is aborted, so the test runs offline. Opens the page with the
token the server printed (without it: the login page), then drives every control a deployment decision needs:
limits, budgets, the system and how it packs, a second budget set, the table selector and a table file, a trace
upload, Recommend and the vLLM export. Saves test-output/explorer.png for a human to look at.
"""
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.test_explorer import free_port, stop_server

pytestmark = pytest.mark.ui

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-quic", "--no-first-run"]
MIXED = "mixed-large: 224²–1344² images, 1–4 per request"
TRACE_CSV = "request,height,width,frames\nr1,1080,1920,1\nr1,720,1280,16\nr2,224,224,1\n"
LOOPBACK = {"127.0.0.1", "localhost"}


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
def workspace(tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    return root


@pytest.fixture
def voila_url(tmp_path, workspace):
    """The page's URL with the token the server printed; its file fields confined to ``workspace``."""
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "JUPYTER_TOKEN"}
    env.update(PYTHONPATH=str(ROOT), GLMVIT_EXPLORER_DIR=str(workspace))
    log_path = tmp_path / "voila.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "glmvit.cli.explorer_serve", "notebooks/explorer.ipynb",
                             "--no-browser", f"--port={port}", "--Voila.ip=127.0.0.1"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, proc)
        (url,) = re.findall(rf"^    (http://127\.0\.0\.1:{port}/\?token=\S+)$", log_path.read_text(), re.M)
        yield url
    finally:
        stop_server(proc, timeout=15)
        log.close()


def loopback_only(route):
    if urlparse(route.request.url).hostname in LOOPBACK:
        route.continue_()
    else:
        route.abort()


def synthetic_table(path: Path) -> Path:
    """A latency table made up for this test only (P99 columns and capture times included)."""
    rows = [{"tokens": t, "graph_ms": 1.0 + 0.004 * t, "eager_ms": 6.0 + 0.005 * t, "graph_p99_ms": 2.0 + 0.004 * t,
             "eager_p99_ms": 9.0 + 0.005 * t} for t in (64, 256, 1024, 4096, 8192)]
    path.write_text(json.dumps({"provenance": {"gpu": "Synthetic GPU"}, "budgets": rows,
                                "capture": {"64": {"seconds": 0.5}, "4096": {"seconds": 2.5}}}))
    return path


def submit(field, text: str) -> None:
    field.fill(text)
    field.press("Enter")


def test_explorer_renders_and_responds(voila_url, workspace, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    synthetic_table(workspace / "my_gpu.json")
    trace = tmp_path / "traffic.csv"
    trace.write_text(TRACE_CSV)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1400})
            page.route("**/*", loopback_only)
            page.goto(voila_url.split("?")[0], wait_until="commit")  # without the token: the login page
            expect(page).to_have_url(re.compile(r"/login"), timeout=30_000)
            page.goto(voila_url, wait_until="commit")
            summary = page.locator(".glmvit-summary")
            expect(summary).to_contain_text("padding waste", timeout=90_000)
            expect(summary).to_contain_text("64 items, 8,192 segments")
            expect(summary).to_contain_text("vLLM 0.33")
            expect(summary).to_contain_text("P99")  # the recorded compiled table is the default
            expect(page.locator(".glmvit-table")).to_contain_text("graph-compiled")
            expect(page.locator(".glmvit-batches")).to_contain_text("replay ms")
            chart = page.locator("img.widget-image")
            expect(chart).to_have_count(1)
            page.wait_for_function("() => document.querySelector('img.widget-image').naturalWidth > 0",
                                   timeout=30_000)  # the SVG decodes in a real browser

            page.locator(".widget-slider", has_text="max items").locator(".noUi-handle").focus()
            page.keyboard.press("ArrowLeft")
            expect(summary).to_contain_text("63 items, 8,192 segments", timeout=30_000)

            budgets = page.get_by_placeholder("64, 256, 1024 or auto")
            submit(budgets, "64, abc")
            expect(page.locator(".glmvit-error")).to_contain_text("is not an integer", timeout=30_000)

            page.locator("select").first.select_option(label=MIXED)
            submit(budgets, "256, 1024, 4096")
            expect(summary).to_contain_text("256, 1024, 4096", timeout=30_000)
            expect(page.locator(".glmvit-error")).to_have_count(0)

            page.get_by_role("button", name="glmvit").click()
            expect(summary).to_contain_text("first-fit decreasing", timeout=30_000)
            expect(page.locator(".glmvit-routing")).to_contain_text("glmvit's runner replays a batch only where")
            page.get_by_role("button", name="engine step").click()
            expect(summary).to_contain_text("per vLLM engine step", timeout=30_000)

            submit(page.get_by_placeholder("second budget set (empty: none)"), "64, 512")
            expect(summary).to_contain_text("budget set B", timeout=30_000)
            expect(summary).to_contain_text("64, 512")

            table_field = page.get_by_placeholder("python -m glmvit latency --json PATH")
            submit(table_field, "/etc/passwd")
            expect(page.locator(".glmvit-error")).to_contain_text("is outside", timeout=30_000)
            submit(table_field, "my_gpu.json")
            expect(page.locator(".glmvit-table")).to_contain_text("my_gpu.json", timeout=30_000)
            expect(page.locator(".glmvit-table")).to_contain_text("Synthetic GPU")
            expect(summary).to_contain_text("every batch at its P99 latency")

            with page.expect_file_chooser() as chooser:  # ipywidgets' upload button opens a detached file input
                page.locator(".widget-upload", has_text="upload trace").click()
            chooser.value.set_files(str(trace))
            expect(summary).to_contain_text("2 requests, 3 items", timeout=30_000)
            expect(page.locator("select").first).to_contain_text("traffic.csv")

            before = summary.inner_text()
            page.get_by_role("button", name="Recommend").click()
            expect(page.locator(".glmvit-info").first).to_contain_text("recommended", timeout=60_000)
            expect(summary).not_to_contain_text("256, 1024, 4096", timeout=30_000)
            assert summary.inner_text() != before

            expect(page.locator(".glmvit-export")).to_contain_text("encoder_cudagraph_token_budgets")
            expect(page.locator(".glmvit-vllm")).to_contain_text("vLLM with this config")
            page.locator(".widget-text", has_text="export to").locator("input").fill("vllm.json")
            page.get_by_role("button", name="Export vLLM config").click()
            expect(page.locator(".glmvit-info").first).to_contain_text("wrote", timeout=30_000)
            assert json.loads((workspace / "vllm.json").read_text())["cudagraph_mm_encoder"] is True

            out = ROOT / "test-output"
            out.mkdir(exist_ok=True)
            page.screenshot(path=str(out / "explorer.png"), full_page=True)
        finally:
            browser.close()
