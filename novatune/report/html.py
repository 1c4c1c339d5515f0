"""Rendering the report's blocks as markdown (images as PNG files beside it) and as one self-contained HTML page
(inline CSS, images as base64 data URIs, no script, no external link: it opens offline and can be mailed).

A block is a tuple: ("h1"|"h2"|"h3", text) · ("p", text) · ("note", text) · ("list", [text]) · ("pre", text) ·
("table", headers, rows) · ("img", file_name, png_bytes, alt). Text may use `code` and **bold** (both outputs).
"""
from __future__ import annotations

import base64
import html
import re
from pathlib import Path

CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, "DejaVu Sans", Arial, sans-serif; margin: 0; background: #f6f7f9;
       color: #1d2329; }
main { max-width: 1040px; margin: 0 auto; padding: 28px 36px 60px; background: #fff; min-height: 100vh; }
h1 { font-size: 26px; margin: 0 0 6px; } h2 { font-size: 20px; margin: 34px 0 10px; padding-bottom: 4px;
border-bottom: 2px solid #e3e6ea; } h3 { font-size: 16px; margin: 20px 0 8px; }
p, li { line-height: 1.5; font-size: 14.5px; }
table { border-collapse: collapse; margin: 10px 0 14px; font-size: 13.5px; }
th, td { border: 1px solid #d9dde2; padding: 5px 10px; text-align: right; white-space: nowrap; }
th { background: #eef1f4; white-space: normal; vertical-align: bottom; }
.tablewrap { overflow-x: auto; max-width: 100%; } td:first-child, th:first-child { text-align: left; }
table.wide { font-size: 12.5px; } table.wide th, table.wide td { padding: 4px 7px; }
td.txt { white-space: normal; overflow-wrap: anywhere; min-width: 12em; } .txt { text-align: left; }
tr:nth-child(even) td { background: #fafbfc; }
code { background: #f0f2f4; padding: 1px 4px; border-radius: 3px; font-size: 12.5px; }
pre { background: #f0f2f4; padding: 10px; overflow-x: auto; font-size: 12px; }
img { max-width: 100%; border: 1px solid #e3e6ea; margin: 6px 0 12px; }
.note { color: #5b6570; font-size: 13px; border-left: 3px solid #d9dde2; padding-left: 10px; }
.headline { font-size: 17px; background: #fff6e5; border: 1px solid #f3d9a4; padding: 10px 14px; border-radius: 6px; }
"""


def _inline_html(text: str) -> str:
    t = html.escape(text, quote=False)
    t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", t)


WIDE_COLS = 7   # tables with this many columns or more get a smaller font and tighter cells (table.wide)
WRAP_CHARS = 28  # a cell longer than this (a message, a kernel name) may wrap (td.txt) instead of widening the page


def _table_html(headers, rows) -> str:
    """A table that fits the page: columns of long text (messages, kernel names) wrap and are left-aligned, wide
    tables are set smaller, and whatever is still too wide scrolls inside its own box (.tablewrap) rather than
    running off the page."""
    cells = [[str(c) for c in r] for r in rows]
    txt = {j for r in cells for j, t in enumerate(r) if len(t) > WRAP_CHARS}

    def cell(tag: str, j: int, t: str) -> str:
        attr = ' class="txt"' if j in txt else ""
        return f"<{tag}{attr}>{_inline_html(t)}</{tag}>"

    head = "".join(cell("th", j, str(h)) for j, h in enumerate(headers))
    body = "".join("<tr>" + "".join(cell("td", j, t) for j, t in enumerate(r)) + "</tr>" for r in cells)
    cls = ' class="wide"' if len(headers) >= WIDE_COLS else ""
    return f'<div class="tablewrap"><table{cls}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _md_cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: list[tuple], out_dir: Path, img_sub: str = "plots") -> str:
    """Markdown text; writes each image to out_dir/img_sub/<file_name>."""
    lines: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + b[1], ""]
        elif kind in ("p", "headline"):
            lines += [b[1], ""]
        elif kind == "note":
            lines += ["> " + b[1], ""]
        elif kind == "list":
            lines += [f"- {x}" for x in b[1]] + [""]
        elif kind == "pre":
            lines += ["```", b[1], "```", ""]
        elif kind == "table":
            headers, rows = b[1], b[2]
            lines.append("| " + " | ".join(_md_cell(h) for h in headers) + " |")
            lines.append("|" + "---|" * len(headers))
            lines += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
            lines.append("")
        elif kind == "img":
            (out_dir / img_sub).mkdir(parents=True, exist_ok=True)
            (out_dir / img_sub / b[1]).write_bytes(b[2])
            lines += [f"![{b[3]}]({img_sub}/{b[1]})", ""]
        else:
            raise ValueError(f"unknown block kind {kind!r}")
    return "\n".join(lines)


def render_html(title: str, blocks: list[tuple]) -> str:
    body: list[str] = []
    for b in blocks:
        kind = b[0]
        if kind in ("h1", "h2", "h3"):
            body.append(f"<{kind}>{_inline_html(b[1])}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{_inline_html(b[1])}</p>")
        elif kind == "headline":
            body.append(f'<p class="headline">{_inline_html(b[1])}</p>')
        elif kind == "note":
            body.append(f'<p class="note">{_inline_html(b[1])}</p>')
        elif kind == "list":
            body.append("<ul>" + "".join(f"<li>{_inline_html(x)}</li>" for x in b[1]) + "</ul>")
        elif kind == "pre":
            body.append(f"<pre>{html.escape(b[1])}</pre>")
        elif kind == "table":
            body.append(_table_html(b[1], b[2]))
        elif kind == "img":
            data = base64.b64encode(b[2]).decode("ascii")
            body.append(f'<img alt="{html.escape(b[3])}" src="data:image/png;base64,{data}">')
        else:
            raise ValueError(f"unknown block kind {kind!r}")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head>\n<body><main>\n"
            + "\n".join(body) + "\n</main></body></html>\n")
