"""The dashboard in a real headless Chromium (Debian's, driven by selenium) while coordinator,
trainer and two workers run on loopback: the token travels in the link's fragment and leaves the
address bar, the page runs under its Content-Security-Policy without a violation, the numbers
change, a rollout opens in the inspector with the trainer's log-probs beside the worker's, and a
screenshot is saved (into $DECENTRL_SCREENSHOT_DIR as well when set). The same run logs to TensorBoard from the trainer
and the coordinator, and the event files are read back."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest
from test_loop import start_system, start_trainer, start_worker, write_config

from decentrl.config import ModelConfig
from decentrl.model.tiny import build_tiny, save_model_dir

webdriver = pytest.importorskip("selenium.webdriver")
pytestmark = pytest.mark.integration

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# The network is closed: no background services, no component updates, a fresh profile.
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1400,1900",
]


@pytest.fixture
def browser(tmp_path):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail(
            "Chromium is missing: run `make browser-tools` (apt-get install chromium chromium-driver)"
        )
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # CSP violations are logged here
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait_for(driver, condition, what: str, timeout: float = 60.0):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # An element of a table the live page redrew meanwhile is stale: look again.
    wait = WebDriverWait(
        driver, timeout, poll_frequency=0.2, ignored_exceptions=[StaleElementReferenceException]
    )
    return wait.until(condition, message=what)


def read_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def click_first(driver, selector: str) -> bool:
    """Click the first element matching `selector`; False when there is none yet or the page
    replaced it between finding and clicking."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        found = driver.find_elements(By.CSS_SELECTOR, selector)
        if not found:
            return False
        found[0].click()
        return True
    except StaleElementReferenceException:
        return False


def number(driver, element_id: str) -> int | None:
    text = driver.find_element("id", element_id).text
    return int(text) if text.isdigit() else None


def test_dashboard_shows_a_running_loop(tmp_path, browser):
    from selenium.webdriver.common.by import By

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    model_dir = save_model_dir(*build_tiny(ModelConfig()), tmp_path / "model")
    config = write_config(
        run_dir,
        "trainer.num_steps=400",
        "trainer.eval_every=0",
        'monitor.trackers=["tensorboard"]',
        "monitor.stats_every_seconds=1.0",
    )
    coordinator, endpoint = start_system(run_dir, model_dir, config)
    roles = [coordinator, start_trainer(run_dir, model_dir, config, endpoint)]
    roles += [start_worker(f"worker-{i}", run_dir, config, endpoint) for i in range(2)]
    try:
        url = endpoint["dashboard_url"]
        page, token = url.split("#token=")  # the token rides in the fragment, never sent to a server
        shell = httpx.get(page)
        assert shell.status_code == 200 and "Content-Security-Policy" in shell.headers
        assert httpx.get(f"{page}?token={token}").status_code == 400  # in a query string: refused
        overview = f"{endpoint['url']}/dashboard/api/overview"
        for headers in [{}, {"Authorization": f"Bearer {endpoint['trainer_token']}"}]:
            assert httpx.get(overview, headers=headers).status_code == 401
        assert httpx.get(f"{overview}?token={token}").status_code == 401
        assert httpx.get(overview, headers={"Authorization": f"Bearer {token}"}).status_code == 200

        browser.get(url)
        # Generous first wait: the roles import torch and warm up (seconds on a quiet machine).
        wait_for(browser, lambda d: (number(d, "latest-version") or 0) >= 1, "a trained version", timeout=300)
        assert "token" not in browser.current_url  # out of the address bar, kept for the tab
        seen = (number(browser, "latest-version"), number(browser, "rollouts-accepted"))
        wait_for(
            browser,
            lambda d: (
                (number(d, "latest-version"), number(d, "rollouts-accepted")) > seen
                and number(d, "latest-version") > seen[0]
            ),
            "the version to advance on the live page",
            timeout=120,
        )
        assert len(browser.find_elements(By.CSS_SELECTOR, "#fleet tbody tr")) == 2
        assert browser.find_elements(By.CSS_SELECTOR, "#chart-learning canvas")

        # The live page redraws its tables every refresh: find and click a row in one go, again if
        # the row found was replaced before the click landed.
        wait_for(
            browser,
            lambda d: click_first(d, "#rollouts tr.rollout-row.inspected"),
            "a rollout with the trainer's log-probs",
            timeout=120,
        )
        tokens = wait_for(
            browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#tokens .token.model"), "tokens"
        )
        assert "trainer log-probs at v" in browser.find_element(By.ID, "rollout-summary").text
        assert "log-prob" in tokens[0].get_attribute("title") and "trainer" in tokens[0].get_attribute(
            "title"
        )
        assert len(browser.find_elements(By.CSS_SELECTOR, "#group tbody tr")) == 4  # the whole group
        browser.find_element(By.CSS_SELECTOR, "input[value=mismatch]").click()
        colours = {
            t.value_of_css_property("background-color")
            for t in browser.find_elements(By.CSS_SELECTOR, "#tokens .token.model")
        }
        assert "rgba(221, 221, 221, 1)" not in colours and "rgb(221, 221, 221)" not in colours  # all reported

        shot = tmp_path / "dashboard.png"
        browser.find_element(By.CSS_SELECTOR, "input[value=logprob]").click()
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 20_000
        if os.environ.get("DECENTRL_SCREENSHOT_DIR"):
            shutil.copy(shot, Path(os.environ["DECENTRL_SCREENSHOT_DIR"]) / "dashboard-test.png")
        browser.refresh()  # the tab still holds its token
        wait_for(browser, lambda d: (number(d, "latest-version") or 0) >= 1, "the page after a reload")
        violations = [
            e["message"] for e in browser.get_log("browser") if "Content Security Policy" in e["message"]
        ]
        assert violations == []

    finally:
        for role in reversed(roles):
            role.stop()
    # The same run fed TensorBoard from both sides (read back with tensorboard's own reader).
    trainer = read_scalars(run_dir / "trackers" / "trainer" / "tensorboard")
    coordinator = read_scalars(run_dir / "trackers" / "coordinator" / "tensorboard")
    assert [step for step, _ in trainer["trainer/reward_mean"]][:2] == [1, 2]
    assert coordinator["coordinator/rollouts_accepted"][-1][1] > 0
