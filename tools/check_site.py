"""Render the built docs site in headless Chromium and report code lines and tables that run past the column.

    make docs && python tools/check_site.py                  # every page of build/site, at 1280 x 900
    python tools/check_site.py --width 1024 --screenshots /tmp/site-shots index.html doctor/index.html

A code block overflows when its text is wider than its box (the reader must scroll sideways to see the
end of a line: a `Fix:` cut off on the right), or when a line of a drawn table (rich's box characters) is
longer than the box (wrapped, the drawing falls apart); a table when it is wider than the column. Lines
longer than the box that wrap (docs/stylesheets/extra.css) are counted, not failed. Each page is
copied (with the whole site, so its styles load) into a temporary folder, a script that measures is
appended to it, and `chromium --headless --dump-dom` prints the page with the measurements in it.
Needs Debian's `chromium` (`apt-get install -y chromium`), not a Python package; CI does not run it.
Screenshots, when asked for, go to the folder given (keep them out of the repository). Exits 1 when
something overflows, 2 when Chromium or the site is missing.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]

# Appended to each page: measures after layout, writes JSON into a <pre> that --dump-dom prints.
_MEASURE = r"""
<script>
(function () {
  const found = {code: [], tables: [], columns: null};
  const probe = document.createElement("span");
  document.querySelectorAll("pre > code").forEach(function (code, i) {
    if (found.columns === null) {
      probe.textContent = "0".repeat(100);
      probe.style.whiteSpace = "pre";
      probe.style.display = "inline-block";
      code.appendChild(probe);
      const char = probe.getBoundingClientRect().width / 100;
      code.removeChild(probe);
      const style = getComputedStyle(code);
      const inner = code.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
      found.columns = Math.floor(inner / char);
    }
    const lines = code.textContent.split("\n");
    const long = lines.filter(function (l) { return l.length > found.columns; });
    const longest = lines.reduce(function (a, b) { return b.length > a.length ? b : a; }, "");
    const drawn = long.filter(function (l) { return /[\u2500-\u257f]/.test(l); });
    if (code.scrollWidth > code.clientWidth + 1 || drawn.length) {
      found.code.push({block: i + 1, longest: longest.length, line: longest.slice(0, 100),
                       overflowing_lines: long.length, broken_drawing: drawn.length});
    }
    found.wrapped = (found.wrapped || 0) + long.length;
  });
  const column = document.querySelector(".md-content__inner") || document.body;
  document.querySelectorAll("article table").forEach(function (table, i) {
    const wrap = table.closest(".md-typeset__scrollwrap");  // the theme's scrolling box, once its script ran
    if (table.scrollWidth > column.clientWidth + 1 || table.scrollWidth > table.clientWidth + 1 ||
        (wrap && wrap.scrollWidth > wrap.clientWidth + 1)) {
      const head = table.querySelector("tr");
      found.tables.push({table: i + 1, width: table.scrollWidth, column: column.clientWidth,
                         header: head ? head.innerText.replace(/\s+/g, " ").slice(0, 100) : ""});
    }
  });
  const out = document.createElement("pre");
  out.id = "site-check-result";
  out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
})();
</script>
"""


def chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def measure(browser: str, page: Path, width: int, height: int, profile: Path, shot: Path | None) -> dict:
    """Load PAGE (a copy with the measuring script appended) and return what the script found."""
    argv = [browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
            "--virtual-time-budget=3000", "--dump-dom", page.as_uri()]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="site-check-result">(.*?)</pre>', done.stdout, re.S)
    if shot is not None:
        subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                        "--virtual-time-budget=3000", f"--screenshot={shot}", page.as_uri()],
                       capture_output=True, timeout=120)
    if not found:
        return {"error": (done.stderr or "no result in the page")[-400:]}
    return json.loads(html.unescape(found.group(1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", help="pages under the site, e.g. doctor/index.html (default: all)")
    parser.add_argument("--site", type=Path, default=ROOT / "build" / "site", help="the built site (make docs)")
    parser.add_argument("--width", type=int, default=1280, help="window width in CSS pixels (default 1280)")
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--screenshots", type=Path, help="also write a PNG of each page into this folder")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    browser = chromium()
    if browser is None:
        print("check_site: no chromium on PATH; install it with `apt-get install -y chromium`", file=sys.stderr)
        return 2
    if not (args.site / "index.html").exists():
        print(f"check_site: no site at {args.site}; build it with `make docs`", file=sys.stderr)
        return 2
    if args.screenshots is not None and args.screenshots.resolve().is_relative_to(ROOT):
        print("check_site: write screenshots outside the repository (e.g. /tmp/site-shots)", file=sys.stderr)
        return 2
    pages = args.pages or sorted(p.relative_to(args.site).as_posix() for p in args.site.rglob("index.html")
                                 if p.parent.name not in ("search", "assets") and "404" not in p.parts)
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="check-site-") as tmp:
        copy = Path(tmp) / "site"
        shutil.copytree(args.site, copy)
        for name in pages:
            page = copy / name
            text = page.read_text()
            page.write_text(text.replace("</body>", _MEASURE + "</body>") if "</body>" in text else text + _MEASURE)
            shot = None
            if args.screenshots is not None:
                args.screenshots.mkdir(parents=True, exist_ok=True)
                shot = args.screenshots / (name.replace("/", "_").removesuffix("_index.html") + ".png")
            report[name] = measure(browser, page, args.width, args.height, Path(tmp) / "profile", shot)
    if args.json:
        print(json.dumps(report, indent=1))
    code = sum(len(r.get("code", [])) for r in report.values())
    tables = sum(len(r.get("tables", [])) for r in report.values())
    errors = [n for n, r in report.items() if "error" in r]
    if not args.json:
        columns = sorted({r["columns"] for r in report.values() if r.get("columns")})
        print(f"{len(pages)} pages at {args.width} px; a code block shows {columns} columns")
        for name, found in report.items():
            for c in found.get("code", []):
                what = (f"{c['broken_drawing']} line(s) of a drawn table wider than the box (they wrap and break "
                        "the drawing)" if c["broken_drawing"] else f"{c['overflowing_lines']} line(s) past the box")
                print(f"{name}: code block {c['block']}: {what}; longest {c['longest']} characters: {c['line']}")
            for t in found.get("tables", []):
                print(f"{name}: table {t['table']} is {t['width']} px in a {t['column']} px column: {t['header']}")
            if "error" in found:
                print(f"{name}: not measured: {found['error']}")
        wrapped = sum(r.get("wrapped", 0) for r in report.values())
        print(f"{code} overflowing code block(s), {tables} overflowing table(s), {len(errors)} page(s) not measured; "
              f"{wrapped} code line(s) longer than the box (wrapped where the site's CSS wraps them)")
    return 1 if code or tables or errors else 0


if __name__ == "__main__":
    sys.exit(main())
