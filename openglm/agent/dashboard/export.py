"""`openglm task export-html ID`: one self-contained HTML file of a trajectory.

The viewer's own stylesheet and script are inlined and the data embedded as JSON, so the file
opens offline, from disk or an e-mail attachment, with no server and no network.
"""

from __future__ import annotations

import json
from pathlib import Path

STATIC = Path(__file__).parent / "static"


def _embed_json(data) -> str:
    # `</` would end the <script> element early: escape it (and the HTML comment openers) in JSON strings
    text = json.dumps(data, ensure_ascii=False, default=str)
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def render(trajectory: dict) -> str:
    page = (STATIC / "trajectory.html").read_text()
    css = (STATIC / "dash.css").read_text()
    js = (STATIC / "common.js").read_text() + "\n" + (STATIC / "trajectory.js").read_text()
    page = page.replace('<link rel="stylesheet" href="dash.css">', f"<style>\n{css}\n</style>")
    page = page.replace('<script src="common.js"></script>', "")
    data = f'<script>window.TRAJECTORY = {_embed_json(trajectory)};</script>'
    return page.replace('<script src="trajectory.js"></script>', f"{data}\n<script>\n{js}\n</script>")
