"""`openglm serve`'s status page: its data from the server's own metrics, the page in headless Chromium."""

import os

import httpx
from browser import PHONE, WIDE, RequestLog, launch
from playwright.sync_api import sync_playwright

API_KEY, MODEL = "test-key-123", "tiny-test"  # the session server of tests/server/conftest.py


def test_status_counts_requests_ttft_and_itl_and_needs_the_key(server, http):
    before = http.get("/v1/status").json()
    for n in (4, 6):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": n,
                                               "temperature": 0})
        assert r.status_code == 200, r.text
    s = http.get("/v1/status").json()
    assert s["requests"] == before["requests"] + 2
    for name in ("ttft", "itl"):
        h = s["histograms"][name]
        assert h["count"] == before["histograms"][name]["count"] + 2 and h["sum"] > 0
        assert h["buckets"][-1]["le"] is None and h["buckets"][-1]["count"] == h["count"]  # +Inf holds them all
    assert s["kv"]["total"] == 96 and 0 <= s["kv"]["use"] <= 1
    assert s["generated_tokens"] >= before["generated_tokens"] + 10
    assert httpx.get(f"{server}/v1/status").status_code == 401
    assert httpx.get(f"{server}/status").status_code == 200  # the page itself holds no data


def test_status_page_renders_in_chromium_without_fetching_off_machine(server, http):
    http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
    with sync_playwright() as p:
        browser = launch(p)
        context = browser.new_context(viewport=WIDE)
        log = RequestLog(context)
        page = context.new_page()
        page.goto(f"{server}/status#token={API_KEY}")
        page.wait_for_function("+document.body.dataset.requests >= 1", timeout=30_000)
        assert page.inner_text("#model") == MODEL
        assert "of 96 blocks in use" in page.inner_text("#kv-detail")
        counted = page.evaluate("[...document.querySelectorAll('#itl rect.bucket')].map((r) => +r.dataset.count)")
        status = http.get("/v1/status").json()
        assert sum(counted) == status["histograms"]["itl"]["count"] >= 1
        assert log.off_machine((server + "/",)) == []
        page.set_viewport_size(PHONE)
        assert page.evaluate("document.scrollingElement.scrollWidth - window.innerWidth") <= 1  # phone width fits
        if shots := os.environ.get("OPENGLM_DASH_SCREENSHOTS"):  # docs/img, shown in docs/agent.md
            page.screenshot(path=f"{shots}/serve-status-phone.png")
            page.set_viewport_size(WIDE)
            page.wait_for_timeout(300)
            page.screenshot(path=f"{shots}/serve-status-desktop.png")
        browser.close()
