"""`browser`: MiniWoB++-style web tasks in a real headless Chromium (docs/environments.md)."""

from decentrl.envs.browser.env import BrowserTasks

__all__ = ["BrowserTasks"]
