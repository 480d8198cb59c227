"""Headless Chromium for the browser environment: one browser per thread, a context per episode.

Playwright's objects belong to the thread (and event loop) that made them, while rollouts
run in whatever event loop their caller started, so each browser lives on a thread of
its own (`BrowserThread`) that runs every call made on it, and a rollout awaits those
calls. A process starts its browsers on first use and keeps them across episodes; each
episode gets a fresh context (no cookies, cache or history shared), an 800x600 viewport,
and a route that lets requests reach the episode's site on 127.0.0.1 and aborts every
other one. Chromium is Debian's (`CHROMIUM_PATH`, else `chromium` on PATH).

What the model sees of a page (`observe`) is a numbered list made by walking the DOM: each
link, button and form field gets an id (kept on the element as `data-rl-id`, which is
how `click 3` finds it) with its accessible name and value, headings and text in between.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
VIEWPORT = {"width": 800, "height": 600}
ACTION_TIMEOUT_MS = 5_000
# Reads of a page that a late navigation keeps destroying before the step gives up.
READ_ATTEMPTS = 3
# The error of an action that would leave the shop's site.
OFF_SITE = "that leads off the site; the browser may only visit the shop"
MAX_NAME_CHARS = 120
MAX_OBSERVATION_CHARS = 6_000
SCREENSHOT_QUALITY = 60

# Numbers every interactive element in document order, drops what is hidden, and names
# each element as an accessibility tree would: aria-label, its <label>, its text.
WALK_DOM = """
() => {
  const items = [];
  let next = 1;
  const clean = (t) => (t || '').replace(/\\s+/g, ' ').trim();
  document.querySelectorAll('[data-rl-id]').forEach((e) => e.removeAttribute('data-rl-id'));
  const shown = (el) => {
    const style = getComputedStyle(el);
    if (style.display === 'none' || style.visibility === 'hidden') return false;
    const box = el.getBoundingClientRect();
    return box.width > 0 && box.height > 0;
  };
  const labelOf = (el) => {
    if (el.getAttribute('aria-label')) return el.getAttribute('aria-label');
    if (el.id) {
      const label = document.querySelector('label[for="' + CSS.escape(el.id) + '"]');
      if (label) return label.innerText;
    }
    const around = el.closest('label');
    return around ? around.innerText : (el.placeholder || el.name || '');
  };
  const roleOf = (el, tag) => {
    const type = (el.getAttribute('type') || '').toLowerCase();
    if (tag === 'a' && el.hasAttribute('href')) return 'link';
    if (tag === 'button' || (tag === 'input' && (type === 'submit' || type === 'button'))) return 'button';
    if (tag === 'input' && type === 'radio') return 'radio';
    if (tag === 'input' && type === 'checkbox') return 'checkbox';
    if (tag === 'input' && type === 'number') return 'spinbutton';
    if (tag === 'input' || tag === 'textarea') return 'textbox';
    return null;
  };
  const walk = (node) => {
    if (node.nodeType === Node.TEXT_NODE) {
      const text = clean(node.textContent);
      if (text) items.push({role: 'text', name: text});
      return;
    }
    if (node.nodeType !== Node.ELEMENT_NODE) return;
    const el = node;
    const tag = el.tagName.toLowerCase();
    if (['script', 'style', 'template', 'noscript'].includes(tag)) return;
    if (el.getAttribute('aria-hidden') === 'true' || !shown(el)) return;
    if (tag === 'input' && (el.getAttribute('type') || '').toLowerCase() === 'hidden') return;
    const role = roleOf(el, tag);
    if (role) {
      const id = next++;
      el.setAttribute('data-rl-id', String(id));
      const name = (role === 'link' || role === 'button')
        ? (el.getAttribute('aria-label') || el.innerText) : labelOf(el);
      const item = {role, id, name: clean(name)};
      if (role === 'textbox' || role === 'spinbutton') item.value = el.value;
      if (role === 'radio' || role === 'checkbox') item.checked = el.checked;
      items.push(item);
      return;
    }
    if (/^h[1-6]$/.test(tag)) { items.push({role: 'heading', name: clean(el.innerText)}); return; }
    // A label's words are its field's name, shown with the field.
    for (const child of el.childNodes) {
      if (tag !== 'label' || child.nodeType === Node.ELEMENT_NODE) walk(child);
    }
  };
  walk(document.body);
  return {title: document.title, items};
}
"""


def chromium_path() -> str:
    """Debian's chromium: `CHROMIUM_PATH`, else `chromium` on PATH."""
    path = os.environ.get("CHROMIUM_PATH") or shutil.which("chromium")
    if not path:
        raise RuntimeError(
            "the browser environment needs Debian's chromium: apt-get install -y chromium "
            "(or set CHROMIUM_PATH to a Chromium binary)"
        )
    return path


def _short(text: str, limit: int = MAX_NAME_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_observation(snapshot: dict) -> str:
    """The page as the model reads it: its title, then one line per element."""
    lines = [f"Page: {_short(str(snapshot.get('title', '')))}"]
    for item in snapshot.get("items", []):
        role, name = item.get("role"), _short(str(item.get("name", "")))
        if role == "text":
            lines.append(name)
        elif role == "heading":
            lines.append(f'heading "{name}"')
        else:
            line = f'[{item["id"]}] {role} "{name}"'
            if "value" in item:
                line += f' value="{_short(str(item["value"]))}"'
            if item.get("checked"):
                line += " (checked)"
            lines.append(line)
    text = "\n".join(lines)
    if len(text) > MAX_OBSERVATION_CHARS:
        text = text[:MAX_OBSERVATION_CHARS] + "\n... (the page goes on)"
    return text


class ActionError(Exception):
    """An action the page could not carry out; its message is meant for the model."""


class Session:
    """One episode's browser context and page. Every method runs on its browser's thread."""

    def __init__(self, browser: Any, start_url: str, screenshot_dir: Path | None):
        self.origin = start_url.split("/e/", 1)[0]
        self.start_url = start_url
        self.screenshot_dir = screenshot_dir
        self.blocked: list[str] = []
        self.roles: dict[int, str] = {}
        # Set when reading the page found it had left the site after an action returned.
        self.strayed = False
        self.context = browser.new_context(viewport=VIEWPORT, service_workers="block")
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.set_default_timeout(ACTION_TIMEOUT_MS)
        self.page.goto(start_url)

    def _route(self, route) -> None:
        url = route.request.url
        if url.startswith(self.origin + "/"):
            route.continue_()
        else:
            self.blocked.append(_short(url, 200))
            route.abort("blockedbyclient")

    def observe(self) -> str:
        """The page as the model reads it. A navigation that began after the action returned
        (a refused off-site request commits its error page late) destroys the page under the
        read: it is waited for and the page read again; if it left the site it is undone
        and `strayed` set, for the step to report as the action's error."""
        from playwright.sync_api import Error as PlaywrightError

        for attempt in range(READ_ATTEMPTS):
            try:
                snapshot = self.page.evaluate(WALK_DOM)
                break
            except PlaywrightError as exc:
                if "context was destroyed" not in str(exc) or attempt == READ_ATTEMPTS - 1:
                    raise
                self.page.wait_for_load_state()
                if not self.page.url.startswith(self.origin + "/"):
                    self.page.go_back()
                    self.strayed = True
        self.roles = {
            item["id"]: item["role"] for item in snapshot.get("items", []) if "id" in item
        }
        return format_observation(snapshot)

    def screenshot(self, name: str) -> str | None:
        """A JPEG of the viewport as `name` in the screenshot folder; its path, or None."""
        if self.screenshot_dir is None:
            return None
        self.screenshot_dir.mkdir(parents=True, exist_ok=True)
        path = self.screenshot_dir / name
        self.page.screenshot(path=str(path), type="jpeg", quality=SCREENSHOT_QUALITY)
        return str(path)

    def _element(self, element_id: int, roles: tuple[str, ...], verb: str):
        role = self.roles.get(element_id)
        if role is None:
            raise ActionError(f"there is no element [{element_id}] on this page")
        if role not in roles:
            raise ActionError(f"cannot {verb} [{element_id}]: it is a {role}")
        return self.page.locator(f'[data-rl-id="{element_id}"]')

    def click(self, element_id: int) -> None:
        locator = self._element(
            element_id, ("link", "button", "radio", "checkbox", "textbox", "spinbutton"), "click"
        )
        self._act(lambda: locator.click())

    def type(self, element_id: int, text: str) -> None:
        locator = self._element(element_id, ("textbox", "spinbutton"), "type into")
        self._act(lambda: locator.fill(text))

    def back(self) -> None:
        before = self.page.url
        if not self._act(self.page.go_back, self.page.go_forward) or self.page.url == before:
            # History starts at the blank page the context opened with, before the shop.
            raise ActionError("there is no earlier page to go back to")

    def _act(self, action: Callable[[], Any], undo: Callable[[], Any] | None = None) -> bool:
        """Run `action` and wait for the page; False (and `undo` run) if it left the site."""
        from playwright.sync_api import Error as PlaywrightError

        try:
            action()
            self.page.wait_for_load_state()
        except PlaywrightError as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else "failed"
            raise ActionError(f"the browser could not do that: {_short(first_line, 200)}") from None
        if self.page.url.startswith(self.origin + "/"):
            return True
        if undo is not None:
            undo()
            return False
        # A link off the site: its request was aborted; stay on the shop.
        self.page.go_back()
        raise ActionError(OFF_SITE)

    def close(self) -> None:
        self.context.close()


class BrowserThread:
    """A thread that owns one Chromium and runs every call on it, in order."""

    def __init__(self, name: str):
        self.jobs: queue.Queue = queue.Queue()
        self.browser: Any = None
        self.playwright: Any = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                break
            future, function, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args))
            except BaseException as exc:  # handed to the caller, who raises it
                future.set_exception(exc)
        if self.playwright is not None:
            if self.browser is not None:
                self.browser.close()
            self.playwright.stop()

    def _ensure_browser(self) -> Any:
        if self.browser is None or not self.browser.is_connected():
            from playwright.sync_api import sync_playwright

            if self.playwright is None:
                self.playwright = sync_playwright().start()
            self.browser = self.playwright.chromium.launch(
                executable_path=chromium_path(), args=CHROMIUM_ARGS
            )
        return self.browser

    def submit(self, function: Callable, *args: Any) -> Future:
        """Run `function(browser, *args)` on this thread; a Future of its result."""
        future: Future = Future()
        self.jobs.put((future, lambda *a: function(self._ensure_browser(), *a), args))
        return future

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=10)


_threads: list[BrowserThread] = []
_threads_lock = threading.Lock()
_next_thread = itertools.count()


def browser_thread(parallel: int) -> BrowserThread:
    """One of the process's first `parallel` browser threads, in turn (started as needed)."""
    with _threads_lock:
        while len(_threads) < parallel:
            _threads.append(BrowserThread(f"browser-{len(_threads)}"))
        return _threads[next(_next_thread) % parallel]


@atexit.register
def _stop_browsers() -> None:
    for thread in _threads:
        thread.stop()
