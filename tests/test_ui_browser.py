"""The web app in a real headless Chromium: `mixfleet ui` started as a subprocess on a free loopback
port, driven with Playwright through the three pages (Plan, Dry-run, Runs), with screenshots saved to
a temporary folder (and to $MIXFLEET_SCREENSHOTS when set). Asserts that the Plan page shows the
chosen mix table and the Pareto chart, that the Dry-run page draws its timeline, and that the Runs
page charts the dry run it finds in the runs folder.

Uses Debian's chromium (/usr/bin/chromium; `.ci/run` installs it) and the Playwright Python package
(the test extra); skipped with the reason when either is missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
START_TIMEOUT_S = 120
PAGE_TIMEOUT_MS = 240_000
VIEWPORT = {"width": 1400, "height": 2600}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"mixfleet ui exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"mixfleet ui did not answer on {url} within {timeout_s} s")


@pytest.fixture()
def app_url(tmp_path: Path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"chromium not installed at {CHROMIUM} (apt-get install chromium; .ci/run does)")
    pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install -e '.[test]')")
    exe = shutil.which("mixfleet")
    argv = [exe] if exe else [sys.executable, "-m", "mixfleet.ui.cli"]
    port = _free_port()
    env = dict(os.environ)  # small dry runs by default; set these to take screenshots on other defaults
    env.setdefault("MIXFLEET_UI_UPDATES", "2")
    env.setdefault("MIXFLEET_UI_WORKLOAD", "tiny-cpu")
    log = (tmp_path / "ui.log").open("w")
    runs = env.get("MIXFLEET_RUNS_DIR") or str(tmp_path / "runs")  # a warm runs folder makes dry runs instant
    proc = subprocess.Popen(argv + ["ui", "--port", str(port), "--runs-dir", runs], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, START_TIMEOUT_S)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    out = (tmp_path / "ui.log").read_text()
    assert "Traceback" not in out, out[-4000:]


def _shot(page, name: str, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / name))
    extra = os.environ.get("MIXFLEET_SCREENSHOTS")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(folder / name, Path(extra) / name)


def _settled(page) -> None:
    """Wait until Streamlit has finished the current script run."""
    page.wait_for_timeout(500)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')",
                           timeout=PAGE_TIMEOUT_MS)


def test_click_through_the_three_pages(app_url: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    shots = tmp_path / "screenshots"
    expect.set_options(timeout=PAGE_TIMEOUT_MS)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            page.goto(app_url)
            expect(page.get_by_role("heading", name="Plan", exact=True)).to_be_visible()
            # Plan: the planner runs with the defaults; the chosen mix and the Pareto chart appear
            page.get_by_role("button", name="Run planner").click()
            mix = page.get_by_test_id("stTable").filter(has_text="replicas")
            expect(mix.first).to_be_visible()
            expect(page.get_by_role("heading", name="Chosen mix")).to_be_visible()
            expect(page.locator(".js-plotly-plot .gtitle", has_text="Cost vs time per update")).to_be_visible()
            _settled(page)
            _shot(page, "plan-page.png", shots)

            page.get_by_test_id("stSidebarNav").get_by_text("Dry-run", exact=True).click()
            expect(page.get_by_role("heading", name="Dry-run", exact=True)).to_be_visible()
            simulate = page.get_by_role("button", name="Simulate")
            if simulate.is_enabled():  # disabled when both dry runs are already in the runs folder
                simulate.click()
            expect(page.locator(".js-plotly-plot .gtitle", has_text="Timeline").first).to_be_visible()
            expect(page.get_by_role("heading", name="Side by side")).to_be_visible()
            _settled(page)
            _shot(page, "dry-run-page.png", shots)

            page.get_by_test_id("stSidebarNav").get_by_text("Runs", exact=True).click()
            expect(page.get_by_role("heading", name="Runs", exact=True)).to_be_visible()
            expect(page.locator(".js-plotly-plot .gtitle", has_text="Reward").first).to_be_visible()
            _settled(page)
            _shot(page, "runs-page.png", shots)
        finally:
            browser.close()
    for name in ("plan-page.png", "dry-run-page.png", "runs-page.png"):
        assert (shots / name).stat().st_size > 10_000
