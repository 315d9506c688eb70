"""Headless Chromium for the dashboard tests: Debian's system browser driven by Playwright (never a download)."""

import os
import shutil

CHROMIUM = os.environ.get("OPENGLM_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
WIDE, PHONE = {"width": 1280, "height": 800}, {"width": 390, "height": 844}


def launch(playwright):
    if not os.path.exists(CHROMIUM) and not shutil.which("chromium"):
        raise RuntimeError("chromium is not installed (make system-deps installs Debian's chromium)")
    executable = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    return playwright.chromium.launch(executable_path=executable, args=FLAGS, headless=True)


class RequestLog:
    """Every URL a page asked for (documents, scripts, fetches, SSE, images, fonts)."""

    def __init__(self, context):
        self.urls: list[str] = []
        context.on("request", lambda r: self.urls.append(r.url))

    def off_machine(self, allowed_prefixes: tuple[str, ...]) -> list[str]:
        return [u for u in self.urls if not u.startswith(allowed_prefixes)]
