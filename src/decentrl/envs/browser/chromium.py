"""A headless Chromium driven over the DevTools protocol on a pipe: no driver, no port, no download.

The browser is the system's (Debian's `chromium`; `make browser-tools` installs it). It is started
with `--remote-debugging-pipe`: commands go in on file descriptor 3 and answers come out on 4, as
JSON messages ended by a NUL byte (what Puppeteer's `pipe: true` speaks). No debugging port is
opened, so no other local process can drive it. Each tab is a target attached in flat mode: its
commands carry the session id. Every command waits at most `timeout` seconds; a browser that
died or hangs raises `BrowserGone`, which the caller turns into an environment failure.

Started with `posix_spawn` (thread-safe: env servers start browsers from request threads) in a
session of its own, so `close` kills the browser with every helper process it forked.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import tempfile
import threading
import time
from itertools import count

from decentrl.envs.live import InstanceBroken

FLAGS = (
    "--headless",
    "--no-sandbox",  # env servers run as root in containers; the page is our own generated HTML
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--mute-audio",
    "--remote-debugging-pipe",
    # Tabs share at most two renderer processes: a session is a tab, and a process per tab would
    # cost ~30 MB each; measured here, a browser with 9 tabs takes 272 MB PSS against 245 MB with one.
    "--renderer-process-limit=2",
)
SYSTEM_BINARIES = ("/usr/lib/chromium/chromium", "/usr/lib/chromium-browser/chromium-browser")
"""The browser binary itself: Debian's /usr/bin/chromium is a shell wrapper that adds flags."""


class BrowserGone(InstanceBroken):
    """The browser exited, closed its pipe, or did not answer in time."""


class BrowserUnavailable(RuntimeError):
    """No Chromium on this machine."""


def find_chromium(path: str | None = None) -> str:
    """The browser to start: `path`, else the system binary, else `chromium` on PATH."""
    for candidate in [path] if path else [*SYSTEM_BINARIES, shutil.which("chromium")]:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise BrowserUnavailable(
        "no Chromium found: install Debian's (`apt-get install -y chromium`, or `make browser-tools`)"
        + (f"; {path!r} is not an executable" if path else "")
    )


def _high_fd(fd: int) -> int:
    """`fd` moved to a number >= 10, close-on-exec: posix_spawn's dup2 onto 3 and 4 must not be a
    no-op on a descriptor that is already 3 or 4 (it would stay close-on-exec)."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class Chromium:
    def __init__(self, binary: str | None = None, timeout: float = 10.0, extra_flags: tuple[str, ...] = ()):
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="decentrl-chromium-")
        to_browser_read, to_browser_write = (_high_fd(fd) for fd in os.pipe())
        from_browser_read, from_browser_write = (_high_fd(fd) for fd in os.pipe())
        binary = find_chromium(binary)
        argv = [binary, *FLAGS, *extra_flags, f"--user-data-dir={self.profile}", "about:blank"]
        self.pid = os.posix_spawn(
            binary,
            argv,
            {**os.environ, "HOME": self.profile},
            file_actions=[
                (os.POSIX_SPAWN_DUP2, to_browser_read, 3),
                (os.POSIX_SPAWN_DUP2, from_browser_write, 4),
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
                (os.POSIX_SPAWN_OPEN, 2, "/dev/null", os.O_WRONLY, 0),
            ],
            setsid=True,
        )
        os.close(to_browser_read)
        os.close(from_browser_write)
        self._out, self._in = to_browser_write, from_browser_read
        self._buffer = b""
        self._ids = count(1)
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)  # a browser never outlives the process that started it
        self.product = str(self.send("Browser.getVersion")["product"])
        """E.g. "Chrome/156.0.8078.114": part of the environment version episodes record."""

    # ------------------------------------------------------------------ transport

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """One command's result; BrowserGone when the browser is dead or late, RuntimeError for a
        command the browser refused."""
        message: dict = {"id": next(self._ids), "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        with self._lock:
            if self._closed:
                raise BrowserGone("the browser was closed")
            try:
                os.write(self._out, json.dumps(message).encode() + b"\0")
            except OSError as exc:
                raise BrowserGone(f"the browser's pipe is closed ({exc})") from None
            deadline = time.monotonic() + self.timeout
            while True:
                answer = self._read(deadline)
                if answer.get("id") == message["id"]:
                    break  # events and answers to abandoned commands are skipped
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error'].get('message', answer['error'])}")
        return answer.get("result", {})

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise BrowserGone(f"no answer from the browser within {self.timeout:.0f} s")
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise BrowserGone("the browser exited")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(raw)

    # ------------------------------------------------------------------ tabs

    def new_tab(self, width: int, height: int) -> str:
        """A fresh tab of `width` x `height` CSS pixels; returns its session id."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        self.send("Emulation.setDeviceMetricsOverride", metrics, session)
        return session

    def close_tab(self, session: str) -> None:
        target = self.send("Target.getTargetInfo", {}, session)["targetInfo"]["targetId"]
        self.send("Target.closeTarget", {"targetId": target})

    def load_html(self, session: str, html: str) -> None:
        frame = self.send("Page.getFrameTree", {}, session)["frameTree"]["frame"]["id"]
        self.send("Page.setDocumentContent", {"frameId": frame, "html": html}, session)

    def evaluate(self, session: str, expression: str) -> object:
        """The JSON value of `expression` in the tab; a thrown exception is a RuntimeError."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(str(details.get("exception", {}).get("description", details.get("text"))))
        return result["result"].get("value")

    def click(self, session: str, x: float, y: float) -> None:
        """A real left click at (x, y): the browser hit-tests it like a user's."""
        for kind in ("mousePressed", "mouseReleased"):
            event = {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1}
            self.send("Input.dispatchMouseEvent", event, session)

    def insert_text(self, session: str, text: str) -> None:
        """Text typed into the focused element, as an input method commits it."""
        self.send("Input.insertText", {"text": text}, session)

    def screenshot(self, session: str) -> bytes:
        import base64

        return base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"}, session)["data"])

    # ------------------------------------------------------------------ life

    def alive(self) -> bool:
        try:
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)  # the browser and every helper it forked
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        for fd in (self._out, self._in):
            os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
