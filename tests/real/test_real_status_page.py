"""The status page (``/onebit/``) in a real browser against a real onebitd on the real decoder, and
against one on the fake decoder fed hostile strings (markup, quotes, control characters) that it
must show as text.

Debian's chromium (scripts/setup installs it when run as root) runs headless, driven by Playwright for
Python pointed at it: Playwright downloads no browser of its own.  Playwright's sync API runs in a
worker thread (it keeps its own event loop); what the test does to onebitd meanwhile (a chat
request, killing the decoder) it asks of this trio run through ``trio.from_thread``.

Every request the page makes is checked: one to any host but onebitd's fails the test, and so does a
console error (a script error, a refused Content-Security-Policy, a failed load).  A screenshot is
kept in the test's tmp path; with ``ONEBIT_DOCS_SCREENSHOT=1`` the run also refreshes
docs/status-page.png, the one docs/operations.md shows.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import trio

from supervisor.routeline import RequestOutcome, RouteLine
from supervisor.testing import Running
from tests.rigs.rig import Control, fake_decoder_config, make_config, real_llama_server, run_daemon

pytestmark = pytest.mark.real

# Small enough for a 2-core machine shared with other suites.
MODEL = {"parallel": 2, "ctx_size": 2048}
DEADLINE_S = 180  # loading SmolLM2 takes about a second; a loaded 2-core machine can take a minute
STEP_MS = 30_000  # Playwright's bound on each wait (a page load, a row, a state)
# A row appears within this long of its route line: the feed sends the line as it is logged.
ROW_WITHIN_S = 1.0
KEY = "status-page-key"
DOCS_SHOT = Path(__file__).parents[2] / "docs" / "status-page.png"


def chromium() -> str:
    """Debian's chromium binary (its /usr/bin/chromium is a shell wrapper); skip without it."""
    for path in ("/usr/lib/chromium/chromium", shutil.which("chromium") or ""):
        if path and os.access(path, os.X_OK):
            return path
    pytest.skip("no chromium: scripts/setup installs Debian's chromium when run as root (apt-get install chromium)")


def sync_playwright() -> Any:
    try:
        from playwright.sync_api import sync_playwright as start
    except ImportError:
        pytest.skip("no playwright: pip install -c constraints.txt -e '.[test]'")
    return start()


class Browser:
    """One headless chromium page on onebitd's page, with every request and console error noted."""

    def __init__(self, playwright: Any, executable: str, url: str) -> None:
        self.origin = "{0.scheme}://{0.netloc}".format(urlsplit(url))
        self.browser = playwright.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        self.context = self.browser.new_context(viewport={"width": 1500, "height": 1100})
        self.errors: list[str] = []
        self.foreign: list[str] = []
        self.requests: list[str] = []
        # Every request that is not to onebitd fails (and is noted): the page works offline.
        self.context.route(lambda u: not u.startswith(self.origin + "/"), self._refuse)
        self.page = self.context.new_page()
        self.page.set_default_timeout(STEP_MS)
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def _refuse(self, route: Any) -> None:
        self.foreign.append(route.request.url)
        route.abort()

    def open(self) -> None:
        self.page.goto(self.origin + "/onebit/")

    def open_live(self) -> None:
        """Open the page and wait for it to show the daemon and read its feed."""
        self.open()
        self.page.wait_for_selector("#main:not([hidden])")
        self.page.wait_for_selector("#feed.up")

    def close(self) -> None:
        self.context.close()
        self.browser.close()

    def key_prompt(self, wrong: str, right: str) -> None:
        """At the key prompt (nothing else shown): ``wrong`` is refused, ``right`` opens the page."""
        page = self.page
        page.wait_for_selector("#key:not([hidden])")
        assert page.is_hidden("#main")
        assert page.locator("#children tbody tr").count() == 0  # nothing of the daemon's shown
        page.fill("#key-input", wrong)
        page.click("#key-form button")
        page.wait_for_selector("#key-error:text('that key was refused')")
        assert page.is_hidden("#main")
        page.fill("#key-input", right)
        page.click("#key-form button")
        page.wait_for_selector("#main:not([hidden])")
        page.wait_for_selector("#feed.up")
        assert page.is_hidden("#key")

    def assert_clean(self) -> None:
        assert self.foreign == []
        assert self.errors == []
        assert self.requests
        assert all(url.startswith(self.origin + "/onebit/") for url in self.requests), self.requests


async def in_browser(running: Running, script: Callable[[Browser], None]) -> None:
    executable = chromium()
    playwright = sync_playwright()

    def run() -> None:
        with playwright as p:
            browser = Browser(p, executable, running.url)
            try:
                script(browser)
            finally:
                browser.close()

    await trio.to_thread.run_sync(run)


async def chat(running: Running, text: str, headers: dict[str, str] | None = None) -> None:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0}
    async with httpx.AsyncClient(base_url=running.url, timeout=DEADLINE_S) as client:
        reply = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert reply.status_code == 200, reply.text


async def chat_line(running: Running, text: str) -> dict[str, Any]:
    """Send a chat request; its route line as the feed gave it (``at``: when it was logged)."""
    with running.daemon.route_stats.watch() as feed:
        await chat(running, text)
        async for event in feed:
            if event["event"] == "line":
                return event
    raise AssertionError("the feed ended")


async def status(running: Running, headers: dict[str, str] | None = None) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=running.url, timeout=DEADLINE_S) as client:
        reply = await client.get("/onebit/status", headers=headers)
        assert reply.status_code == 200
        result: dict[str, Any] = reply.json()
        return result


def state_of(page: Any, child: str) -> str:
    text: str = page.inner_text(f'#children tr[data-child="{child}"] .state')
    return text


async def test_the_page_shows_requests_as_they_end_and_a_killed_decoder_restarting(short_dir: Path) -> None:
    real_llama_server()
    config = make_config(short_dir, model=MODEL, hybrid={"enabled": False})
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config) as running:
            await chat(running, "Say hello.")  # a request before the page opens: the feed's hello has it
            seen: dict[str, float] = {}

            def script(browser: Browser) -> None:
                page = browser.page
                browser.open_live()
                assert page.is_hidden("#key")
                assert state_of(page, "decoder") == "ready"
                assert page.locator("#requests tbody tr").count() == 1
                # A chat request sent now shows in the table within a second of its route line.
                ended = trio.from_thread.run(chat_line, running, "Name a colour.")
                row = f'#requests tr[data-req="{ended["line"]["req"]}"]'
                page.wait_for_selector(row, timeout=ROW_WITHIN_S * 1000)
                seen["row_after_s"] = time.time() - ended["at"]
                assert page.inner_text(f"{row} .route") == "plain"
                assert page.inner_text(f"{row} .outcome") == "ok"
                # The decoder killed by its pid, from the status the page reads: restarting, then ready.
                pid = trio.from_thread.run(status, running)["models"]["models"][0]["pid"]
                os.kill(pid, signal.SIGKILL)
                page.wait_for_function(
                    """() => ["backoff", "starting"].includes(
                        document.querySelector('#children tr[data-child="decoder"] .state')?.textContent)""",
                    polling="raf",
                )
                seen["restarting"] = 1
                page.wait_for_function(
                    """() => document.querySelector('#children tr[data-child="decoder"] .state')
                        ?.textContent === "ready" """
                )
                trio.from_thread.run(chat, running, "Count to three.")
                page.wait_for_selector("#requests tbody tr:nth-child(3)")
                assert page.inner_text('#children tr[data-child="decoder"] td:nth-child(4)') == "1"  # restarts
                # The plots drew each request that ended well.
                assert page.locator("#plot-scatter circle").count() == 3
                assert page.locator("#plot-decode circle").count() == 3
                # Never a prompt's or a reply's text.
                assert "colour" not in page.content()
                shot = short_dir / "status-page.png"
                page.screenshot(path=str(shot), full_page=True)
                if os.environ.get("ONEBIT_DOCS_SCREENSHOT"):
                    shutil.copyfile(shot, DOCS_SHOT)
                browser.assert_clean()

            await in_browser(running, script)
    assert seen["row_after_s"] < ROW_WITHIN_S
    assert seen["restarting"] == 1
    assert (short_dir / "status-page.png").stat().st_size > 10_000


async def test_with_api_keys_the_page_shows_only_the_key_prompt_until_given_the_key(short_dir: Path) -> None:
    real_llama_server()
    config = make_config(short_dir, model=MODEL, hybrid={"enabled": False}, server={"api_keys": [KEY]})
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config) as running:

            def script(browser: Browser) -> None:
                browser.open()
                browser.key_prompt("a wrong key", KEY)
                assert state_of(browser.page, "decoder") == "ready"
                # The key was sent as a header, never in a URL.
                assert not [url for url in browser.requests if KEY in url]
                # The 401s the page met while it had no key (or a wrong one) are console errors of
                # the browser's; no other error, and no request outside onebitd.
                browser.errors[:] = [e for e in browser.errors if "401" not in e]
                browser.assert_clean()

            await in_browser(running, script)


async def test_with_admin_keys_the_page_asks_for_one_and_an_api_key_is_refused(
    short_dir: Path, control: Control
) -> None:
    config = fake_decoder_config(short_dir, server={"api_keys": [KEY], "admin_keys": ["the-admin-key"]})
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config) as running:

            def script(browser: Browser) -> None:
                browser.open()
                browser.key_prompt(KEY, "the-admin-key")  # an API key opens the API, not this page
                # The 403s the page met without the admin key are console errors of the browser's.
                browser.errors[:] = [e for e in browser.errors if "403" not in e]
                browser.assert_clean()

            await in_browser(running, script)


def estimated(n: int, route: str, estimate_ms: float, actual_ms: float) -> RouteLine:
    """A request the cost decision estimated: on plain the decoder's prefill is the actual, on the
    file route the provider's prefill and the restore."""
    if route == "plain":
        return RouteLine(
            req=f"est-{n}", endpoint="/v1/chat/completions", est_plain_ms=estimate_ms, decoder_prompt_ms=actual_ms
        )
    return RouteLine(
        route=route,
        req=f"est-{n}",
        endpoint="/v1/chat/completions",
        est_hybrid_ms=estimate_ms,
        prefill_ms=actual_ms - 10.0,
        restore_ms=10.0,
        provider="npu",
        engine="openvino",
    )


async def test_the_page_shows_the_estimates_against_the_actuals_per_route_and_engine(
    short_dir: Path, control: Control
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(fake_decoder_config(short_dir)) as running:
            stats = running.daemon.route_stats
            # Plain: two within 1.5x (1.2, 0.8), one 3x slower than estimated; the file route: one, 1.0.
            for n, (route, estimate_ms, actual_ms) in enumerate(
                [("plain", 100.0, 120.0), ("plain", 100.0, 80.0), ("plain", 100.0, 300.0), ("file", 1000.0, 1000.0)]
            ):
                stats.record(estimated(n, route, estimate_ms, actual_ms))
            rows: list[list[str]] = []

            def script(browser: Browser) -> None:
                browser.open_live()
                browser.page.wait_for_selector("#estimates tbody tr:nth-child(2)")
                rows.extend(
                    browser.page.evaluate(
                        """() => [...document.querySelectorAll("#estimates tbody tr")]
                            .map((row) => [...row.cells].map((cell) => cell.textContent))"""
                    )
                )
                browser.assert_clean()

            await in_browser(running, script)
    assert rows == [["file", "openvino", "1", "1", "100%"], ["plain", "decoder", "3", "1.2", "67%"]]


# Each would run script if the page parsed it as markup: each sets window.pwned.
HOSTILE = [
    "<script>window.pwned = 1</script>",
    '"><img src=x onerror="window.pwned = 2">',
    "'><svg onload=window.pwned=3>",
    "</td></tr><tr><td><iframe src=javascript:window.pwned=4>",
    "a\x00b\x07c\x1b[31md\u202ee\nf\r\ng",
]
# What survives the error's redaction (supervisor/observe/redact.py: no quote): still markup.
HOSTILE_ERROR = "<script>window.pwned = 5</script><img src=x onerror=window.pwned=6>"


def hostile_line(n: int, text: str) -> RouteLine:
    return RouteLine(
        route=text,
        req=f"hostile-{n}",
        endpoint=text,
        model=text,
        fallback=text,
        status=500,
        outcome=RequestOutcome.ERROR,
        error=f"{HOSTILE_ERROR} {text}",
    )


def hostile_status(real: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """The daemon's status with names, states and words that are markup; a child's state of control
    characters (the page makes a class of it, which must not throw)."""

    def status() -> dict[str, Any]:
        data = real()
        data["daemon"]["version"] = HOSTILE[0]
        for child in data["children"]:
            child["name"], child["state"], child["last_exit"] = HOSTILE[1], HOSTILE[4], HOSTILE[3]
        for model in data["models"]["models"]:
            model["name"], model["state"] = HOSTILE[0], HOSTILE[1]
        return data

    return status


async def test_hostile_strings_in_route_lines_model_names_and_errors_are_shown_as_text_and_run_nothing(
    short_dir: Path, control: Control
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(fake_decoder_config(short_dir)) as running:
            stats = running.daemon.route_stats
            page_data = running.daemon.front.page
            assert page_data is not None
            page_data.status = hostile_status(page_data.status)
            for n, text in enumerate(HOSTILE[:-1]):  # before the page opens: in the feed's hello
                stats.record(hostile_line(n, text))
            shown: dict[str, Any] = {}

            def script(browser: Browser) -> None:
                page = browser.page
                browser.open_live()
                # One more as the feed's own event, and a transition of a hostile child.
                trio.from_thread.run_sync(stats.record, hostile_line(len(HOSTILE) - 1, HOSTILE[-1]))
                page.wait_for_selector(f'#requests tr[data-req="hostile-{len(HOSTILE) - 1}"]')
                event = {"event": "child", "model": HOSTILE[0], "child": HOSTILE[1], "from": "ready", "to": HOSTILE[2]}
                trio.from_thread.run_sync(stats.publish, event)
                page.wait_for_selector("#models tbody tr")
                shown.update(
                    page.evaluate(
                        """() => {
                        const text = (selector) => [...document.querySelectorAll(selector)].map((e) => e.textContent);
                        return {
                            pwned: window.pwned === undefined ? null : window.pwned,
                            markup: document.querySelectorAll("main img, main script, main svg:not([id]), main iframe")
                                .length,
                            scripts: document.querySelectorAll("script").length,
                            rows: document.querySelectorAll("#requests tbody tr").length,
                            routes: text("#requests tbody .route"),
                            errors: text("#requests tbody td:last-child"),
                            models: text("#models tbody td:first-child"),
                            children: text("#children tbody td:first-child"),
                            states: text("#children tbody .state"),
                            daemon: document.getElementById("daemon").textContent,
                        };
                    }"""
                    )
                )
                browser.assert_clean()

            await in_browser(running, script)
    assert shown["pwned"] is None  # no payload ran
    assert shown["markup"] == 0  # none was made an element
    assert shown["scripts"] == 1  # the page's own, /onebit/page.js
    assert shown["rows"] == len(HOSTILE)
    # Each shown as the very text it was, newest first; control characters and all.
    assert shown["routes"] == HOSTILE[::-1]
    for error, text in zip(shown["errors"], HOSTILE[::-1], strict=True):
        assert error.startswith(HOSTILE_ERROR)
        assert "\x00" not in error  # the feed's redaction took the control characters out
        if "'" not in text and '"' not in text and "\x00" not in text:
            assert error == f"{HOSTILE_ERROR} {text}"
    assert shown["models"] == [f"{HOSTILE[0]} (default)"]
    assert shown["children"] == [HOSTILE[1]]
    assert shown["states"][0] in (HOSTILE[2], HOSTILE[4])
    assert HOSTILE[0] in shown["daemon"]
