"""Headless Chromium (Debian's `chromium` + `chromium-driver`) driven by selenium, for the
browser proofs. `chrome()` yields a driver with a fresh profile; `missing()` says in one
line why browser tests cannot run here (then they skip)."""

from __future__ import annotations

import contextlib
import http.server
import shutil
import tempfile
import threading
from collections.abc import Iterator

from testkit.wait import eventually

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run")  # fmt: skip


def missing() -> str | None:
    import os

    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        return "chromium/chromium-driver not installed (tests/scripts/install-tools.sh)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed (tests/requirements.txt)"
    return None


@contextlib.contextmanager
def chrome() -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="sluice-chromium-")
    opts = Options()
    opts.binary_location = CHROMIUM
    for a in (*ARGS, f"--user-data-dir={profile}"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_script_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def page_eventually(driver, script: str, timeout: float = 60.0):
    """`testkit.wait.eventually` for a JS expression in the page: its first truthy value."""
    return eventually(lambda: driver.execute_script("return " + script), timeout=timeout,
                      message=f"the page to say {script}")  # fmt: skip


@contextlib.contextmanager
def static_site(html: str) -> Iterator[str]:
    """Serve one page at / on a free loopback port (another origin than the server's)."""
    body = html.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
