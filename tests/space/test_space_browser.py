"""The Space in a real headless Chromium driven by Playwright: type a prompt, watch the answer arrive as colored
per-pass spans with live figures, move the τ slider mid-answer, see plain AR and the plot. Saves a screenshot
(outputs/space_screenshot.png). Chromium is the system's (Debian's `chromium` package, installed by .ci/run):
without it this test fails in CI, so that CI never passes without having looked at the page, and skips elsewhere
with the line that installs it."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright
from space_app import running_app

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = Path(__file__).resolve().parents[2] / "outputs" / "space_screenshot.png"


@pytest.fixture(scope="module")
def served():
    """(browser, url, forward-pass counter) around the app served as in test_space."""
    if not Path(CHROMIUM).exists():
        missing = pytest.fail if os.environ.get("CI") else pytest.skip
        missing(
            f"No Chromium at {CHROMIUM}: install it (`apt-get install -y chromium`, as .ci/run does) or set "
            "CHROMIUM to a Chromium binary. `playwright install` is not needed."
        )
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_app(Path(tmp), pass_seconds=0.03) as (_, url, calls),
        sync_playwright() as pw,
    ):
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield browser, url, calls
        browser.close()


def open_page(browser, url):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    expect(page.locator("#message textarea")).to_be_visible(timeout=30_000)
    return page


def set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def pass_sizes(page) -> list[int]:
    return [
        int(n) for n in page.locator("#mars-spans .mars-pass[data-n]").evaluate_all("els => els.map(e => e.dataset.n)")
    ]


def test_type_generate_move_the_slider_and_screenshot(served, tmp_path):
    page = open_page(*served[:2])
    page.locator("#lossless input[type=checkbox]").uncheck()  # τ-mode: the slider sets what is accepted
    set_number(page, "tau", 1)
    page.locator("#message textarea").fill("Count from 1 to 9.")
    page.locator("#message textarea").press("Enter")

    # The answer streams in: spans appear one pass at a time, with live figures.
    expect(page.locator("#mars-spans .mars-pass[data-n]").nth(5)).to_be_attached(timeout=30_000)
    expect(page.locator("#mars-figures")).to_contain_text("τ now 1.00")
    # Move the slider with the mouse, to about τ = 0.3, while the answer is being written.
    track = page.locator("#tau input[type=range]")
    box = track.bounding_box()
    page.mouse.click(box["x"] + 0.3 * box["width"], box["y"] + box["height"] / 2)
    moved = float(page.locator("#tau input[type=number]").input_value())
    assert 0.2 <= moved <= 0.4, moved

    expect(page.locator("#mars-figures")).to_contain_text("mean τ", timeout=60_000)  # MARS done
    sizes = pass_sizes(page)
    assert sizes[:5] == [1] * 5, sizes  # τ = 1: one token per pass
    assert max(sizes) > 1, sizes  # after the slider moved: several tokens in one pass
    assert len(set(sizes)) >= 2
    colors = page.locator("#mars-spans .mars-pass[data-n]").evaluate_all(
        "els => [...new Set(els.map(e => getComputedStyle(e).backgroundColor))]"
    )
    assert len(colors) >= 2, colors  # passes of different sizes are colored differently
    expect(page.locator("#mars-figures")).to_contain_text("tokens/forward")
    expect(page.locator("#mars-figures")).to_contain_text("tokens/s")

    expect(page.locator("#ar-figures")).to_contain_text("speed-up", timeout=60_000)  # plain AR, side by side
    assert page.locator("#ar-text textarea").input_value()
    for plot in ("#plot-forward", "#plot-speed"):  # one point per run (MARS, AR), drawn in a visible color
        page.wait_for_function(
            """plot => { const colors = [...document.querySelectorAll(plot + ' [aria-roledescription=point]')]
                 .map(e => e.getAttribute('stroke') || e.getAttribute('fill'));
                 return colors.length === 2 && colors.every(c => c && c !== 'transparent'); }""",
            arg=plot,
            timeout=30_000,
        )
    assert page.locator("#chat").inner_text().count("Count from 1 to 9.") == 1

    shot = tmp_path / "space_screenshot.png"
    page.screenshot(path=str(shot), full_page=True)
    SCREENSHOT.parent.mkdir(exist_ok=True)
    shutil.copy(shot, SCREENSHOT)
    assert shot.stat().st_size > 20_000


def test_closing_the_tab_stops_its_generation(served):
    browser, url, calls = served
    page = open_page(browser, url)
    set_number(page, "tau", 1)
    set_number(page, "max-new", 512)  # about 15 s of passes
    page.locator("#message textarea").fill("a long answer")
    page.locator("#message textarea").press("Enter")
    expect(page.locator("#mars-spans .mars-pass[data-n]").nth(5)).to_be_attached(timeout=30_000)
    page.close()
    deadline = time.time() + 10
    while True:  # the server notices the closed connection, closes the generator, and the thread stops
        before = calls[0]
        time.sleep(0.5)
        if calls[0] == before:
            break
        assert time.time() < deadline, "the generation kept running after its tab was closed"
