"""Screenshot a report in headless Chromium (Debian's), for the README or a CI artifact.

    python scripts/screenshot_report.py results/logit-probes-cpu/report.html docs/report.png --show diverged
"""

from __future__ import annotations

import argparse
from pathlib import Path

from playwright.sync_api import sync_playwright

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--show", default="all", help="the viewer's 'show' filter: all, diverged, identical, problems")
    parser.add_argument("--width", type=int, default=1240)
    parser.add_argument("--start", default="", help="begin at this section (overview, charts, runs); default: the top")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=FLAGS)
        page = browser.new_page(viewport={"width": args.width, "height": 900})
        page.goto(args.report.resolve().as_uri())
        page.wait_for_selector("body[data-ready='1']")
        page.select_option("#filter-show", args.show)
        args.png.parent.mkdir(parents=True, exist_ok=True)
        top = page.locator(f"#{args.start}").bounding_box()["y"] if args.start else 0
        height = page.evaluate("document.documentElement.scrollHeight")
        page.screenshot(path=str(args.png), full_page=True,
                        clip={"x": 0, "y": top, "width": args.width, "height": height - top})
        browser.close()
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
