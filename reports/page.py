"""One self-contained HTML page: inline CSS, plotly.js inlined once, figures and tables in order.

Nothing on the page is fetched: the plotly library is embedded (the same bundle that
``include_plotlyjs=True`` inlines) so a report opens offline and in air-gapped labs.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

CSS = """
body { font-family: "DejaVu Sans", Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1300px;
       color: #222; line-height: 1.4; }
h1 { font-size: 26px; margin-bottom: 4px; }
h2 { font-size: 20px; margin-top: 32px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
p.note { color: #555; font-size: 14px; }
div.table { overflow-x: auto; }
table { border-collapse: collapse; margin: 12px 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; vertical-align: top; }
th { background: #f3f3f3; }
td.text, th.text { text-align: left; }
td.pass { background: #d8f0d8; color: #145214; font-weight: bold; }
td.fail { background: #f7d4d4; color: #8a1010; font-weight: bold; }
td.diff { background: #fff2c2; }
.banner { display: inline-block; padding: 6px 14px; border-radius: 4px; font-weight: bold; font-size: 18px; }
.banner.pass { background: #d8f0d8; color: #145214; }
.banner.fail { background: #f7d4d4; color: #8a1010; }
.banner.undecided { background: #f7ecc8; color: #6b4a00; }
pre { font-size: 12px; max-width: 600px; white-space: pre-wrap; word-break: break-all; margin: 0; text-align: left; }
"""

PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}


@dataclass(frozen=True)
class Cell:
    """A table cell: its text and an optional CSS class (``pass``, ``fail``, ``diff``, ``text``)."""

    text: str
    css: str = ""
    preformatted: bool = False


@dataclass
class Page:
    title: str
    parts: list[str] = field(default_factory=list)
    _figures: int = 0

    def heading(self, text: str, level: int = 2) -> None:
        self.parts.append(f"<h{level}>{html.escape(text)}</h{level}>")

    def note(self, text: str) -> None:
        self.parts.append(f'<p class="note">{html.escape(text)}</p>')

    def banner(self, text: str, passed: bool | None) -> None:
        """A coloured line: green when ``passed``, red when not, amber when None (undecided)."""
        kind = "undecided" if passed is None else "pass" if passed else "fail"
        self.parts.append(f'<p><span class="banner {kind}">{html.escape(text)}</span></p>')

    def figure(self, fig: go.Figure) -> None:
        self._figures += 1
        self.parts.append(
            fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"figure-{self._figures}", config=PLOTLY_CONFIG)
        )

    def table(self, header: list[str], rows: list[list[Cell | str]]) -> None:
        head = "".join(f'<th class="{"text" if i == 0 else ""}">{html.escape(h)}</th>' for i, h in enumerate(header))
        body = []
        for row in rows:
            cells = []
            for i, cell in enumerate(row):
                cell = cell if isinstance(cell, Cell) else Cell(str(cell), "text" if i == 0 else "")
                text = html.escape(cell.text)
                cells.append(f'<td class="{cell.css}">{f"<pre>{text}</pre>" if cell.preformatted else text}</td>')
            body.append("<tr>" + "".join(cells) + "</tr>")
        self.parts.append(f'<div class="table"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>')

    def html(self) -> str:
        return (
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(self.title)}</title><style>{CSS}</style>"
            f'<script type="text/javascript">{get_plotlyjs()}</script></head>\n'
            f"<body><h1>{html.escape(self.title)}</h1>\n" + "\n".join(self.parts) + "\n</body></html>\n"
        )

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.html(), encoding="utf-8")
        return path
