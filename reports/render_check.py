"""Does a report render offline? Open it in headless Chromium with no network, screenshot it, check the plots.

The command it runs (Debian's ``chromium``; the same by hand, then look at the PNG)::

    chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \\
        --disable-background-networking --disable-component-update --disable-sync \\
        --user-data-dir=/tmp/profile --virtual-time-budget=10000 \\
        --host-resolver-rules="MAP * ~NOTFOUND" \\
        --window-size=1400,3000 --screenshot=shot.png --dump-dom file:///abs/path/report.html

(``--dump-dom`` prints the DOM after the scripts ran). Plots drew when every figure ``div``
became a ``js-plotly-plot`` holding a ``main-svg`` with traces; the screenshot is not blank
when its pixels vary. Usage:
``python -m reports.render_check REPORT.html [--png shot.png]`` (exit status 1 when it did not render).
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--virtual-time-budget=10000",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # no host name resolves: a report that fetched anything would fail
)
WINDOW = (1400, 3000)


@dataclass(frozen=True)
class RenderResult:
    figures: int  # figure divs in the report
    drawn: int  # of those, turned by plotly.js into an SVG plot with at least one trace
    traces: int  # traces drawn across all figures
    pixel_std: float  # standard deviation of the screenshot's grey levels (0: blank)
    distinct_colors: int  # distinct RGB colours in the screenshot
    png: Path

    @property
    def ok(self) -> bool:
        return self.figures > 0 and self.drawn == self.figures and self.pixel_std > 5 and self.distinct_colors > 16

    def __str__(self) -> str:
        return (f"{self.drawn}/{self.figures} figures drawn, {self.traces} traces; screenshot {self.png}: "
                f"grey-level std {self.pixel_std:.1f}, {self.distinct_colors} colours: {'ok' if self.ok else 'NOT RENDERED'}")


def render_check(report: Path, png: Path, chromium: Path = CHROMIUM, timeout_s: float = 120) -> RenderResult:
    """Render ``report`` headless and offline, screenshot it to ``png``; count drawn plots and measure the pixels."""
    report = Path(report).resolve()
    png = Path(png).resolve()
    with tempfile.TemporaryDirectory(prefix="kvsim-chromium-") as profile:
        cmd = [str(chromium), *FLAGS, f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
               f"--screenshot={png}", "--dump-dom", report.as_uri()]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not png.is_file():
        raise RuntimeError(f"{chromium} exited {done.returncode} without a screenshot: {done.stderr.strip()[-500:]}")
    figures = figure_traces(done.stdout)
    pixels = decode_png(png.read_bytes())[..., :3].astype(np.uint32)
    packed = (pixels[..., 0] << 16) | (pixels[..., 1] << 8) | pixels[..., 2]
    return RenderResult(len(figures), sum(1 for n in figures if n > 0), sum(figures), float(pixels.mean(axis=-1).std()),
                        len(np.unique(packed)), png)


def figure_traces(dom: str) -> list[int]:
    """Per figure div of the report, the traces plotly.js drew in it (0 when it made no SVG plot)."""
    counts = []
    for chunk in re.split(r'(?=<div id="figure-\d+")', dom)[1:]:
        opening = chunk[: chunk.index(">")]
        drew = "js-plotly-plot" in opening and 'class="main-svg"' in chunk
        counts.append(len(re.findall(r'class="trace (?:scatter|bars)', chunk)) if drew else 0)
    return counts


def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB or RGBA PNG (non-interlaced, as Chromium writes them) as a (height, width, channels) array."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    if header is None:
        raise ValueError("PNG without IHDR")
    width, height, depth, color_type, _, _, interlace = header
    channels = {2: 3, 6: 4}.get(color_type)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"unsupported PNG: bit depth {depth}, colour type {color_type}, interlace {interlace}")
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(height, 1 + width * channels)
    if raw[:, 0].max() > 4:
        raise ValueError(f"PNG: unknown row filter {raw[:, 0].max()}")
    return _unfilter(raw[:, 0], raw[:, 1:].reshape(height, width, channels))


def _unfilter(filters: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Undo PNG's per-row filters (None, Sub, Up, Average, Paeth) on ``rows`` (height, width, channels).

    A byte depends only on its left, upper and upper-left neighbours, so the pixels of one
    anti-diagonal (same ``x + y``) are independent. Rows are skewed (pixel (y, x) stored at
    column y + x) to make each anti-diagonal a column: width + height vectorised steps
    instead of a Python loop per byte.
    """
    height, width, bpp = rows.shape
    skewed_in = np.zeros((height, width + height, bpp), dtype=np.uint8)
    for y in range(height):
        skewed_in[y, y : y + width] = rows[y]
    # decoded pixel (y, x) at [y + 1, y + x + 1]; row 0 and column 0 are the zero border PNG assumes
    out = np.zeros((height + 1, width + height + 1, bpp), dtype=np.int16)
    kinds = filters.astype(np.int16)[:, None]
    for t in range(height + width - 1):
        lo, hi = max(0, t - width + 1), min(height, t + 1)
        a, b, c = out[lo + 1 : hi + 1, t], out[lo:hi, t], out[lo:hi, t - 1]  # left, up, up-left
        p = a + b - c
        pa, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - c)
        paeth = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))
        predictor = np.choose(kinds[lo:hi], (np.zeros_like(a), a, b, (a + b) >> 1, paeth))
        out[lo + 1 : hi + 1, t + 1] = (skewed_in[lo:hi, t] + predictor) & 0xFF
    return np.stack([out[y + 1, y + 1 : y + 1 + width] for y in range(height)]).astype(np.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description="Render a kvsim report in headless Chromium and check its plots drew.")
    parser.add_argument("report", type=Path)
    parser.add_argument("--png", type=Path, default=Path("report.png"), help="Where the screenshot goes (default: report.png).")
    args = parser.parse_args()
    result = render_check(args.report, args.png)
    print(result)
    raise SystemExit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
