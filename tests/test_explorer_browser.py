"""The metric explorer (notebooks/recalibration_metric) as a user drives it: JupyterLab on the loopback, the system's
Chromium under Playwright, Run All, then every control changed with the mouse and the keyboard. Each change must
redraw the figure, deterministically (the same control values give the same image bytes; back at the defaults, the
default bytes), with no traceback anywhere, and the kernel must hold the values the controls show.

The headless notebook tests never run a widget callback after the first draw; this is the test that does. It is
marked ``browser`` and run by ``make test-browser``, not by ``make test``; it skips, saying why, where Playwright or
a Chromium is missing (``make browser`` installs Debian's). Every wait is bounded and the server, its kernels and
the browser are shut down whatever happens. ``LRMOE_BROWSER_SCREENSHOTS=<folder>`` also keeps a screenshot of the
explorer there.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "recalibration_metric.ipynb"
CHROMIUMS = ("chromium", "chromium-browser", "google-chrome")
WAIT_MS = 120_000  # one browser-side wait (a page load, Run All's slowest cell, one redraw) on a busy 2-core machine
SETTLE_S = 1.5  # an image counts as drawn once it has not changed for this long
# JupyterLab's settings for the test: the notebook's kernel started without asking, every cell in the DOM (the
# default windowing detaches those out of view) and no request to the news feed
LAB_SETTINGS = {"@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "autoStartDefaultKernel": True},
                "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False}}


def chromium() -> str:
    """The browser to drive: $LRMOE_CHROMIUM, else the first Chromium on PATH; skips when there is none."""
    path = os.environ.get("LRMOE_CHROMIUM") or next(filter(None, map(shutil.which, CHROMIUMS)), None)
    if not path:
        pytest.skip(f"no Chromium on PATH ({', '.join(CHROMIUMS)}) and LRMOE_CHROMIUM unset: `make browser` "
                    "installs Debian's")
    return path


@pytest.fixture
def tools():
    """Playwright's sync API and the Chromium to drive, or a skip that says which is missing."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (`make browser`)")
    return sync_api, chromium()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, token: str, path: str, method: str = "GET"):
    request = urllib.request.Request(f"{url}/api/{path}", method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
    return json.loads(body) if body else None


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 (a free port, a random token) serving a copy of the explorer notebook, its
    settings, workspaces and runtime files under ``tmp_path``; yields (url, token, log path)."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    for name, settings in LAB_SETTINGS.items():
        path = tmp_path / "settings" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings))
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"), "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "LRMOE_NOTEBOOK_QUICK": os.environ.get("LRMOE_NOTEBOOK_QUICK", "1"),  # the kernel's mode; 0: full size
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    log = tmp_path / "jupyterlab.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
             f"--ServerApp.root_dir={root}", "--ServerApp.allow_root=True", "--LabApp.news_url=",
             "--LabApp.extension_manager=readonly"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                api(url, token, "status")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    state = "exited" if server.poll() is not None else "did not answer within 90 s"
                    pytest.fail(f"JupyterLab {state}:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield url, token, log
    finally:
        stop_server(server, url, token)


def stop_server(server: subprocess.Popen, url: str, token: str) -> None:
    """Shut the kernels down through the server, then the server (SIGTERM, then SIGKILL to its process group)."""
    try:
        for kernel in api(url, token, "kernels") or []:
            api(url, token, f"kernels/{kernel['id']}", method="DELETE")
    except OSError:
        pass  # the server is gone already: it took its kernels with it
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)


class Explorer:
    """The explorer's widgets and figure on the JupyterLab page, operated as a user operates them."""

    def __init__(self, page, url: str, token: str):
        self.page, self.url, self.token = page, url, token
        self.box = page.locator(".widget-interact").first

    def image(self) -> str:
        """The figure as drawn now: its PNG's data URL ('' while there is none)."""
        img = self.box.locator("img")
        return (img.first.get_attribute("src") or "") if img.count() else ""

    def kernel_idle(self) -> bool:
        return all(k["execution_state"] == "idle" for k in api(self.url, self.token, "kernels") or [])

    def redrawn(self, previous: str, what: str) -> str:
        """Waits for a figure other than ``previous``, then for the kernel to be idle (no redraw still queued) with
        the figure unchanged for SETTLE_S; returns it."""
        deadline = time.monotonic() + WAIT_MS / 1000
        current = self.image()
        while not current or current == previous:
            if time.monotonic() > deadline:
                pytest.fail(f"the figure did not redraw within {WAIT_MS // 1000} s after {what}")
            self.page.wait_for_timeout(200)
            current = self.image()
        stable_since = time.monotonic()
        while time.monotonic() - stable_since < SETTLE_S or not self.kernel_idle():
            if time.monotonic() > deadline:
                pytest.fail(f"the figure did not settle within {WAIT_MS // 1000} s after {what}")
            self.page.wait_for_timeout(200)
            now = self.image()
            if now != current:
                current, stable_since = now, time.monotonic()
        assert_no_traceback(self.page, f"after {what}")
        return current

    def slider(self, label: str):
        return self.box.locator(".widget-hslider").filter(has_text=label)

    def readout(self, label: str) -> str:
        return self.slider(label).locator(".widget-readout").inner_text().strip()

    def choose_metric(self, metric: str) -> None:
        self.box.locator(".widget-dropdown select").select_option(metric)

    def choose_mode(self, mode: str) -> None:
        self.box.locator(".widget-toggle-button").filter(has_text=re.compile(f"^{mode}$")).click()

    def nudge(self, label: str, steps: int) -> None:
        """Moves a slider by ``steps`` of its step with the arrow keys on its focused handle."""
        handle = self.slider(label).locator(".noUi-handle")
        handle.focus()
        for _ in range(abs(steps)):
            handle.press("ArrowRight" if steps > 0 else "ArrowLeft")


def assert_no_traceback(page, when: str) -> None:
    text = page.locator(".jp-Notebook").inner_text()
    for sign in ("Traceback", "Error displaying widget", "Model not found"):
        assert sign not in text, f"{sign!r} on the page {when}:\n{text[text.find(sign) - 200:][:3000]}"


def wait_for_kernel(page, url: str, token: str) -> None:
    """Until the server's kernel for the notebook is idle with the page connected to it (the page's indicator reads
    idle before it connects as well)."""
    deadline = time.monotonic() + WAIT_MS / 1000
    while not any(k["execution_state"] == "idle" and k["connections"] for k in api(url, token, "kernels") or []):
        if time.monotonic() > deadline:
            pytest.fail(f"no kernel was started and idle within {WAIT_MS // 1000} s: {api(url, token, 'kernels')}")
        page.wait_for_timeout(500)
    page.wait_for_function(
        "() => document.querySelector('.jp-Notebook-ExecutionIndicator')?.getAttribute('data-status') === 'idle'",
        timeout=WAIT_MS)


def run_all(page) -> None:
    """Run > Run All Cells from the menu bar; waits until every code cell has an execution count."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Run All Cells$")).click()
    page.wait_for_function(
        """() => {
            const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
            return prompts.length > 0 && prompts.every(p => /^\\[\\d+\\]:$/.test(p.textContent.trim()));
        }""", timeout=WAIT_MS * 3)


def run_new_cell(page, code: str) -> str:
    """Adds a code cell at the end (Esc, B under the last cell), types ``code``, runs it (Shift+Enter); returns its
    output text."""
    cells = page.locator(".jp-Notebook .jp-Cell")
    before = cells.count()
    cells.last.locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    page.wait_for_function(f"() => document.querySelectorAll('.jp-Notebook .jp-Cell').length > {before}",
                           timeout=WAIT_MS)
    page.keyboard.press("Enter")
    page.keyboard.insert_text(code)
    page.keyboard.press("Shift+Enter")
    output = cells.nth(before).locator(".jp-OutputArea-output")
    output.first.wait_for(timeout=WAIT_MS)
    return output.first.inner_text()


def test_explorer_redraws_deterministically_as_its_controls_move(tools, lab, tmp_path):
    (sync_api, executable), (url, token, log) = tools, lab
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, timeout=WAIT_MS,
                                             args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 900})
            page.set_default_timeout(WAIT_MS)
            page.goto(f"{url}/lab/tree/{NOTEBOOK.name}?reset&token={token}")
            page.locator(".jp-Notebook .jp-Cell").first.wait_for()
            wait_for_kernel(page, url, token)
            run_all(page)
            assert_no_traceback(page, "after Run All")
            explorer = Explorer(page, url, token)
            default = explorer.redrawn("", "Run All")
            shoot(page, explorer, tmp_path)
            assert (explorer.readout("retention"), explorer.readout("Zipf")) == ("0.70", "0.80")

            seen = {}  # the image of every state visited, keyed by the state

            def change(what, action, state):
                action()
                image = explorer.redrawn(change.last, what)
                if state in seen:
                    assert image == seen[state], f"{what}: not the image this state drew before"
                assert image not in {v for k, v in seen.items() if k != state}, f"{what}: another state's image"
                seen[state], change.last = image, image

            change.last = default
            seen[("m2", "topk", 0, 0)] = default
            change("metric m1", lambda: explorer.choose_metric("m1"), ("m1", "topk", 0, 0))
            change("metric random", lambda: explorer.choose_metric("random"), ("random", "topk", 0, 0))
            change("metric back to m2", lambda: explorer.choose_metric("m2"), ("m2", "topk", 0, 0))
            change("mode unbiased", lambda: explorer.choose_mode("unbiased"), ("m2", "unbiased", 0, 0))
            change("mode back to topk", lambda: explorer.choose_mode("topk"), ("m2", "topk", 0, 0))
            change("retention one step up", lambda: explorer.nudge("retention", 1), ("m2", "topk", 1, 0))
            assert explorer.readout("retention") == "0.75"
            change("retention back", lambda: explorer.nudge("retention", -1), ("m2", "topk", 0, 0))
            change("skew one step down", lambda: explorer.nudge("Zipf", -1), ("m2", "topk", 0, -1))
            assert explorer.readout("Zipf") == "0.70"
            change("skew back", lambda: explorer.nudge("Zipf", 1), ("m2", "topk", 0, 0))
            # a state reached by another path: the same image
            change("metric m3", lambda: explorer.choose_metric("m3"), ("m3", "topk", 0, 0))
            change("mode unbiased", lambda: explorer.choose_mode("unbiased"), ("m3", "unbiased", 0, 0))
            change("retention one step up", lambda: explorer.nudge("retention", 1), ("m3", "unbiased", 1, 0))
            change("retention another step up", lambda: explorer.nudge("retention", 1), ("m3", "unbiased", 2, 0))
            change("random, unbiased", lambda: explorer.choose_metric("random"), ("random", "unbiased", 2, 0))
            change("metric m3 again", lambda: explorer.choose_metric("m3"), ("m3", "unbiased", 2, 0))

            state = run_new_cell(page, "print({k: round(v, 6) if isinstance(v, float) else v "
                                       "for k, v in sorted(explorer.kwargs.items())})")
            assert state.strip() == str({"metric": "m3", "mode": "unbiased", "rho": 0.8, "skew": 0.8}), (
                "the kernel does not hold the values the controls show")
            assert_no_traceback(page, "at the end")
        finally:
            browser.close()
    assert "Traceback" not in log.read_text(), f"the server logged a traceback:\n{log.read_text()[-3000:]}"


def shoot(page, explorer: Explorer, tmp_path: Path) -> None:
    """The window with the explorer at the top of the notebook's view, into ``tmp_path`` and
    $LRMOE_BROWSER_SCREENSHOTS."""
    explorer.box.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(500)
    path = tmp_path / "explorer.png"
    page.screenshot(path=path)
    if os.environ.get("LRMOE_BROWSER_SCREENSHOTS"):
        out = Path(os.environ["LRMOE_BROWSER_SCREENSHOTS"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, out / path.name)
