"""The static site builds from the committed results and holds up in a real
browser (Debian's headless Chromium, driven by Playwright over CDP): every
page loads from file:// without console errors or network requests, every
chart renders, every link inside the site resolves, and every number shown
outside charts and rendered documents is found in a committed JSON file."""

import bisect
import json
import pathlib
import re
import shutil
import subprocess
import urllib.parse

import pytest
from playwright.sync_api import sync_playwright

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "target" / "site-test"
DIST = ARTIFACTS / "dist"
# A number standing on its own: not part of a word (p95, cc10, bcb659b) or a
# dotted version (6.18.44).
TOKEN = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])")


def committed_numbers():
    """Every number in the committed result files and published.json,
    including numbers inside their strings (dates, notes, sources), except
    raw samples: the site quotes their summaries and, for per-batch series,
    the last value, so only those count (thousands of raw samples would let
    almost any printed number pass)."""
    found = []

    def walk(v):
        if isinstance(v, bool) or v is None:
            return
        if isinstance(v, (int, float)):
            found.append(float(v))
        elif isinstance(v, str):
            found.extend(float(t) for t in TOKEN.findall(v))
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for key, x in v.items():
                if key == "samples" and isinstance(x, dict):
                    for series in x.values():
                        found.extend(float(s) for s in series[-1:] if s is not None)
                else:
                    walk(x)

    files = sorted((ROOT / "benchmarks" / "results").glob("*.json")) + [ROOT / "benchmarks" / "published.json"]
    for f in files:
        walk(json.loads(f.read_text()))
    return sorted(found)


def is_committed(token, numbers):
    """Whether some committed value rounds to `token` at its printed precision."""
    decimals = len(token.split(".")[1]) if "." in token else 0
    x, tol = float(token), 0.5 * 10**-decimals + 1e-9
    i = bisect.bisect_left(numbers, x - tol)
    return i < len(numbers) and numbers[i] <= x + tol


def test_is_committed_rounds_like_the_site():
    numbers = sorted([27.126, 1316.28, 2026.0])
    assert is_committed("27.13", numbers)
    assert is_committed("1316.3", numbers)
    assert is_committed("2026", numbers)
    assert not is_committed("27.2", numbers)
    assert not is_committed("48", numbers)


@pytest.fixture(scope="module")
def site():
    binary = ROOT / "target" / "release" / "copse-site"
    assert binary.exists(), "build it first: mise run build"
    if DIST.exists():
        shutil.rmtree(DIST)
    subprocess.run([str(binary), "--out", str(DIST)], cwd=ROOT, check=True)
    return DIST


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing (scripts/bootstrap installs it)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield b
        b.close()


VISIBLE_TEXT = """() => {
  const body = document.body.cloneNode(true);
  body.querySelectorAll('svg, .prose, pre').forEach(e => e.remove());
  return body.innerText;
}"""


def test_every_page(site, browser):
    pages = sorted(site.glob("*.html"))
    assert {"index.html", "compare.html", "methodology.html", "architecture.html", "freebsd.html"} <= {
        p.name for p in pages
    }
    numbers = committed_numbers()
    results = {json.loads(f.read_text())["rig"] for f in (ROOT / "benchmarks" / "results").glob("*.json")}
    for path in pages:
        page = browser.new_page()
        problems, requests = [], []
        page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(path.as_uri())
        page.wait_for_load_state("load")
        assert problems == [], f"{path.name}: {problems}"
        assert all(u.startswith("file://") for u in requests), f"{path.name} requested {requests}"

        charts = page.query_selector_all("figure.chart svg")
        rig = path.name.removeprefix("rig-").removesuffix(".html")
        if path.name.startswith("rig-") and rig in results:
            assert charts, f"{path.name}: a measured rig has no chart"
        for chart in charts:
            box = chart.bounding_box()
            assert box and box["width"] > 300 and box["height"] > 60, f"{path.name}: chart not rendered: {box}"
            assert chart.evaluate("s => s.querySelectorAll('rect, polyline, path, circle').length") > 1
            assert chart.evaluate("s => s.getBBox().width") > 100, f"{path.name}: chart draws nothing"

        for href in page.eval_on_selector_all("a[href]", "as => as.map(a => a.getAttribute('href'))"):
            if href.startswith(("http://", "https://")):
                continue
            target = urllib.parse.unquote(href.split("#")[0])
            assert (site / target).exists(), f"{path.name}: broken link {href}"

        text = page.evaluate(VISIBLE_TEXT)
        strays = [t for t in TOKEN.findall(text) if not is_committed(t, numbers)]
        assert strays == [], f"{path.name}: numbers not in any committed JSON: {strays[:20]}"
        if path.name == "index.html":
            page.screenshot(path=str(ARTIFACTS / "home.png"), full_page=True)
        if path.name == "rig-create-latency.html":
            page.screenshot(path=str(ARTIFACTS / "rig-create-latency.png"), full_page=True)
        page.close()
    assert (ARTIFACTS / "home.png").exists() and (ARTIFACTS / "rig-create-latency.png").exists()


def test_unmeasured_rigs_say_so(site):
    measured = {json.loads(f.read_text())["rig"] for f in (ROOT / "benchmarks" / "results").glob("*.json")}
    pages = list(site.glob("rig-*.html"))
    assert pages
    for p in pages:
        html = p.read_text()
        rig = p.name.removeprefix("rig-").removesuffix(".html")
        assert ("not yet measured" in html) == (rig not in measured), p.name
    home = (site / "index.html").read_text()
    assert "not yet measured" in home or measured >= {"pause-resume", "net", "clone", "from-snapshot"}
