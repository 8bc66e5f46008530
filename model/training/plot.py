"""A hand-written SVG of a training run (no matplotlib): loss on the left, accuracy on the right.

Input is the list of metrics.jsonl records the trainer writes ("train" records every `log_every`
steps, "eval" records after each evaluation). Any browser opens the file.
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Any

from datadir.files import atomic_write_bytes

WIDTH, HEIGHT = 960, 380
PANEL_W, PANEL_H = 380, 260
MARGIN_L, MARGIN_T = 70, 60
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]

# (panel title, [(record type, key, legend label)])
PANELS = [
    (
        "loss",
        [
            ("train", "loss", "train loss"),
            ("train", "mlm_loss", "train MLM loss"),
            ("eval", "loss", "eval loss"),
            ("eval", "mlm_loss", "eval MLM loss"),
            ("eval", "mse", "eval MSE"),
        ],
    ),
    (
        "accuracy",
        [
            ("eval", "mlm_accuracy", "eval MLM accuracy"),
            ("eval", "nsp_accuracy", "eval NSP accuracy"),
            ("eval", "accuracy", "eval accuracy"),
            ("eval", "macro_f1", "eval macro-F1"),
            ("eval", "cosine_ndcg@10", "eval NDCG@10"),
            ("eval", "spearman_cosine", "eval Spearman"),
        ],
    ),
]


def write_training_plot(records: list[dict[str, Any]], path: str | Path, title: str = "training") -> None:
    atomic_write_bytes(Path(path), render_svg(records, title).encode())


def render_svg(records: list[dict[str, Any]], title: str = "training") -> str:
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="24" text-anchor="middle" font-size="16">{escape(title)}</text>',
    ]
    for i, (name, series) in enumerate(PANELS):
        lines = [(label, _points(records, kind, key)) for kind, key, label in series]
        lines = [(label, pts) for label, pts in lines if pts]
        parts.append(_panel(MARGIN_L + i * (PANEL_W + 100), MARGIN_T, name, lines))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _points(records: list[dict[str, Any]], kind: str, key: str) -> list[tuple[float, float]]:
    pts = []
    for r in records:
        value = r.get(key)
        if r.get("type") == kind and isinstance(value, (int, float)) and math.isfinite(value):
            pts.append((float(r["step"]), float(value)))
    return pts


def _panel(x0: float, y0: float, name: str, lines: list[tuple[str, list[tuple[float, float]]]]) -> str:
    out = [
        f'<g><text x="{x0 + PANEL_W / 2}" y="{y0 - 10}" text-anchor="middle" font-size="14">{name}</text>',
        f'<rect x="{x0}" y="{y0}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#888"/>',
    ]
    if not lines:
        out.append(
            f'<text x="{x0 + PANEL_W / 2}" y="{y0 + PANEL_H / 2}" text-anchor="middle" fill="#888">no data yet</text></g>'
        )
        return "\n".join(out)
    xs = [p[0] for _, pts in lines for p in pts]
    ys = [p[1] for _, pts in lines for p in pts]
    (xlo, xhi), (ylo, yhi) = _range(min(xs), max(xs)), _range(min(ys), max(ys))
    if name == "accuracy":
        ylo, yhi = min(ylo, 0.0), max(yhi, 1.0) if yhi > 0.5 else yhi

    def sx(x: float) -> float:
        return x0 + (x - xlo) / (xhi - xlo) * PANEL_W

    def sy(y: float) -> float:
        return y0 + PANEL_H - (y - ylo) / (yhi - ylo) * PANEL_H

    for t in _ticks(xlo, xhi):
        out.append(
            f'<line x1="{sx(t):.1f}" y1="{y0 + PANEL_H}" x2="{sx(t):.1f}" y2="{y0 + PANEL_H + 4}" stroke="#888"/>'
            f'<text x="{sx(t):.1f}" y="{y0 + PANEL_H + 16}" text-anchor="middle">{_fmt(t)}</text>'
        )
    for t in _ticks(ylo, yhi):
        out.append(
            f'<line x1="{x0}" y1="{sy(t):.1f}" x2="{x0 + PANEL_W}" y2="{sy(t):.1f}" stroke="#eee"/>'
            f'<text x="{x0 - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>'
        )
    out.append(f'<text x="{x0 + PANEL_W / 2}" y="{y0 + PANEL_H + 32}" text-anchor="middle">step</text>')
    for j, (label, pts) in enumerate(lines):
        color = COLORS[j % len(COLORS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        if len(pts) < 30:
            out.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"/>' for x, y in pts)
        ly = y0 + 14 + 16 * j
        out.append(
            f'<line x1="{x0 + PANEL_W - 150}" y1="{ly - 4}" x2="{x0 + PANEL_W - 130}" y2="{ly - 4}" '
            f'stroke="{color}" stroke-width="2"/><text x="{x0 + PANEL_W - 125}" y="{ly}">{escape(label)}</text>'
        )
    out.append("</g>")
    return "\n".join(out)


def _range(lo: float, hi: float) -> tuple[float, float]:
    if hi - lo < 1e-12:
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    return lo, hi


def _ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    raw = (hi - lo) / target
    step = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if raw <= step * mult:
            step *= mult
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.1e}"
    return f"{v:.4g}"
