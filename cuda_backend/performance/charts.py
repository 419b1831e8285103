"""PNG charts of a report (matplotlib, Agg backend, no display needed).

speedup.png    speed-up over CPU NumPy per operation (largest size measured), coloured by
               family (legend), each bar labelled with its input shapes and dtype
bandwidth.png  achieved GB/s against size for the vector family, one panel per kind of op
               (two inputs, one input, reductions, fills and copies), with the measured ceiling
roofline.png   arithmetic intensity against achieved GFLOP/s, with memory and compute roofs;
               the LABELLED fastest operations named on the chart, the others in its legend
peers.png      our speed relative to each GPU peer per operation (peer time / our time)
transfers.png  host<->device and device copy GB/s against size
In fallback mode each chart's title starts with the fallback warning.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Dict, List, Optional, Tuple

from .render import FAMILY_TITLES, case_size

FAMILY_COLORS = {"vector": "#1f77b4", "matrix": "#ff7f0e", "ml": "#2ca02c",
                 "transfers": "#9467bd", "training": "#8c564b"}
FAILED_COLOR = "#d62728"
CHARTS = ("speedup.png", "bandwidth.png", "roofline.png", "peers.png", "transfers.png")
LABELLED = 6          # roofline: operations named on the chart (the highest GFLOP/s)
MARKERS = "os^vDP*Xph<>"
# bandwidth.png panels: (title, test on a case)
BANDWIDTH_PANELS = (
    ("two inputs (a op b)", lambda c: len(c["shapes"]) >= 2),
    ("reductions", lambda c: c["op"].startswith(("reduce", "arg"))),
    ("fills and copies", lambda c: c["op"] in ("fill", "zeros", "ones", "copy")),
    ("one input", lambda c: True),
)


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _title(doc: Dict[str, Any], text: str) -> str:
    name = doc["device"]["name"]
    if doc.get("fallback_mode"):
        return f"FALLBACK MODE (no GPU): {text}\n{name}: NumPy stands in for the GPU"
    return f"{text}\n{name}"


def _empty(ax: Any, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, fontsize=10,
            transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _label(c: Dict[str, Any]) -> str:
    v = f" [{c['variant']}]" if c["variant"] else ""
    return f"{c['op']}{v}"


def headline(cases: List[Dict[str, Any]], key: str) -> List[Dict[str, Any]]:
    """Per op and variant, the measured case with the largest size (float32 preferred)
    that has a value for `key`, in family order."""
    best: Dict[Tuple[str, str, str], Dict[str, Any]] = {}
    for c in cases:
        if c["status"] == "skipped" or c.get(key) is None:
            continue
        k = (c["family"], c["op"], c["variant"])
        cur = best.get(k)
        rank = (c["dtype"] == "float32", c["size"])
        if cur is None or rank > (cur["dtype"] == "float32", cur["size"]):
            best[k] = c
    order = list(FAMILY_COLORS)
    return sorted(best.values(), key=lambda c: (order.index(c["family"]), c["op"], c["variant"]))


def _case_label(c: Dict[str, Any]) -> str:
    """'add [row broadcast]  64x64, 64  float32': what ran, with its real input shapes."""
    return f"{_label(c)}  {case_size(c)}  {c['dtype']}"


def _family_legend(ax: Any, families: List[str], failed: bool) -> None:
    from matplotlib.patches import Patch
    handles = [Patch(color=FAMILY_COLORS[f], label=FAMILY_TITLES.get(f, f)) for f in families]
    if failed:
        handles.append(Patch(color=FAILED_COLOR, label="failed its accuracy check"))
    ax.legend(handles=handles, fontsize=7, loc="lower right")


def _bar_labels(ax: Any, ys: List[float], vals: List[float]) -> None:
    for y, v in zip(ys, vals):
        if v:
            ax.text(v, y, f" {v:.2f}x", va="center", fontsize=6)


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path)
    return os.path.basename(path)


def speedup_chart(doc: Dict[str, Any], path: str) -> str:
    rows = headline(doc["cases"], "speedup_vs_cpu")
    fig = _figure(9, max(3.0, 0.28 * len(rows) + 1.8))
    ax = fig.add_subplot(111)
    if rows:
        y = range(len(rows))
        vals = [c["speedup_vs_cpu"] for c in rows]
        ax.barh(list(y), vals,
                color=[FAMILY_COLORS[c["family"]] if c["status"] == "passed" else FAILED_COLOR
                       for c in rows])
        _bar_labels(ax, list(y), vals)
        ax.set_yticks(list(y))
        ax.set_yticklabels([_case_label(c) for c in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_xlabel("speed-up over CPU NumPy (x, log scale; > 1: faster than NumPy)")
        _family_legend(ax, [f for f in FAMILY_COLORS if any(c["family"] == f for c in rows)],
                       any(c["status"] != "passed" for c in rows))
    else:
        _empty(ax, "no case was measured against the CPU")
    ax.set_title(_title(doc, "Speed-up over CPU NumPy, largest size per operation"),
                 fontsize=9)
    return _save(fig, path)


def _bandwidth_panels(doc: Dict[str, Any]) -> List[Tuple[str, Dict[str, list]]]:
    """The vector family's float32 GB/s series, split into BANDWIDTH_PANELS (each series in
    the first panel whose test it passes); empty panels left out."""
    panels: List[Tuple[str, Dict[str, list]]] = [(t, {}) for t, _ in BANDWIDTH_PANELS]
    for c in doc["cases"]:
        if c["family"] == "vector" and c["dtype"] == "float32" and c.get("gbps"):
            for (title, test), (_, series) in zip(BANDWIDTH_PANELS, panels):
                if test(c):
                    series.setdefault(_label(c), []).append((c["size"], c["gbps"]))
                    break
    return [(t, s) for t, s in panels if s]


def bandwidth_chart(doc: Dict[str, Any], path: str) -> str:
    panels = _bandwidth_panels(doc)
    ceiling = doc["ceilings"].get("memory_bandwidth_gbps")
    if not panels:
        fig = _figure(10, 5.5)
        ax = fig.add_subplot(111)
        _empty(ax, "no vector-family case was measured")
        ax.set_title(_title(doc, "Vector family: achieved bandwidth against size"), fontsize=9)
        return _save(fig, path)
    import matplotlib
    cmap = matplotlib.colormaps["tab10"]
    cols = 2 if len(panels) > 1 else 1
    rows = -(-len(panels) // cols)
    fig = _figure(6.5 * cols, 4.2 * rows + 0.6)
    first = None
    for k, (title, series) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, k + 1, sharey=first)
        first = first or ax
        for i, (label, pts) in enumerate(sorted(series.items())):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, ms=4,
                    marker=MARKERS[i % len(MARKERS)], color=cmap(i % 10),
                    ls="-" if i < 10 else "--", label=label)
        if ceiling:
            ax.axhline(ceiling, color="black", ls="--", lw=1,
                       label=f"copy bandwidth {ceiling:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{title} ({len(series)})", fontsize=9)
        ax.set_xlabel("elements (float32)", fontsize=8)
        ax.set_ylabel("GB/s (bytes read + written / median)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, ncol=2 if len(series) > 6 else 1, loc="upper left")
    fig.suptitle(_title(doc, "Vector family: achieved bandwidth against size"), fontsize=9)
    return _save(fig, path)


def roofline_chart(doc: Dict[str, Any], path: str) -> str:
    """roofline.png, one figure drawn layer by layer: the roofs, every size, the best point
    per op with the LABELLED fastest named."""
    fig = _figure(12, 6.5)
    ax = fig.add_subplot(111)
    pts = [c for c in doc["cases"] if c.get("arithmetic_intensity") and c.get("gflops")]
    if not pts:
        _empty(ax, "no case with both a FLOP and a byte count was measured")
    else:
        _roofs(ax, pts, doc["ceilings"].get("memory_bandwidth_gbps"),
               doc["ceilings"].get("compute", {}))
        # every measured size as a faint dot of its family's colour
        for fam, color in FAMILY_COLORS.items():
            fp = [c for c in pts if c["family"] == fam]
            if fp:
                ax.scatter([c["arithmetic_intensity"] for c in fp], [c["gflops"] for c in fp],
                           s=8, color=color, alpha=0.3, zorder=2, label=f"{fam} (every size)")
        _best_points(ax, pts)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / byte)")
        ax.set_ylabel("achieved GFLOP/s")
        ax.legend(fontsize=6, ncol=2, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(_title(doc, "Roofline (colour: family; the fastest operations named, the "
                             "rest in the legend)"), fontsize=9)
    return _save(fig, path)


def _roofs(ax: Any, pts: List[Dict[str, Any]], bw: Optional[float],
           compute: Dict[str, Any]) -> None:
    """The roofline's roofs over the measured intensities (from a quarter of the lowest to 4x
    the highest, at least 100): memory (capped at the highest peak) and the peak of each
    compute unit the points ran on."""
    import numpy as np
    ai = [c["arithmetic_intensity"] for c in pts]
    x = np.logspace(np.log10(min(ai) / 4), np.log10(max(max(ai) * 4, 100)), 200)
    units = sorted({c["compute_unit"] for c in pts if c.get("compute_unit")})
    peaks = [(u, compute[u]["gflops"]) for u in units
             if compute.get(u, {}).get("gflops")]
    if bw:
        ax.plot(x, bw * x if not peaks else np.minimum(bw * x, max(p for _, p in peaks)),
                color="black", lw=1.5, label=f"memory roof {bw:.0f} GB/s")
    for (u, p), style in zip(peaks, ("-", "--", "-.", ":", "-", "--")):
        roof = np.minimum(bw * x, p) if bw else np.full_like(x, p)
        ax.plot(x, roof, color="gray", ls=style, lw=1,
                label=f"{u} peak {p / 1e3:.1f} TFLOP/s")


def _best_points(ax: Any, pts: List[Dict[str, Any]]) -> None:
    """One roofline point per operation (its best GFLOP/s): the LABELLED fastest named on
    the chart, the others with a marker of their own in the legend."""
    best: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for c in pts:
        k = (c["op"], c["variant"])
        if k not in best or c["gflops"] > best[k]["gflops"]:
            best[k] = c
    ranked = sorted(best.values(), key=lambda c: -c["gflops"])
    # their names stacked in the empty lower right (high intensity, low GFLOP/s), each
    # with a line to its point, so they cannot overlap one another or the roofs
    named = sorted(ranked[:LABELLED], key=lambda c: -c["arithmetic_intensity"])
    for n, c in enumerate(named):
        ax.scatter([c["arithmetic_intensity"]], [c["gflops"]], s=36, marker="o",
                   color=FAMILY_COLORS[c["family"]], edgecolor="black", zorder=4)
        ax.annotate(f"{_label(c)} {c['dtype']}: {c['gflops'] / 1e3:.3g} TFLOP/s",
                    (c["arithmetic_intensity"], c["gflops"]), fontsize=7,
                    xytext=(0.97, 0.36 - 0.055 * n), textcoords="axes fraction",
                    ha="right", va="center", zorder=5,
                    arrowprops=dict(arrowstyle="-", lw=0.6, color="0.4",
                                    shrinkA=2, shrinkB=3),
                    bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="0.7", lw=0.5))
    for i, c in enumerate(sorted(ranked[LABELLED:], key=lambda c: (c["family"], _label(c)))):
        ax.scatter([c["arithmetic_intensity"]], [c["gflops"]], s=22, zorder=3,
                   marker=MARKERS[i % len(MARKERS)], color=FAMILY_COLORS[c["family"]],
                   edgecolor="black", linewidth=0.4, label=_label(c))


def peers_chart(doc: Dict[str, Any], path: str) -> str:
    import numpy as np
    names = [n for n, p in doc["peers"].items() if p.get("device") == "gpu"]
    live = [n for n in names if doc["peers"][n]["available"]]
    rows = [c for c in headline(doc["cases"], "time_ms")
            if any(c["peers"].get(n, {}).get("ratio") for n in live)]
    fig = _figure(9, max(3.0, 0.32 * len(rows) + 1.8))
    ax = fig.add_subplot(111)
    if rows:
        y = np.arange(len(rows))
        h = 0.8 / max(1, len(live))
        for i, n in enumerate(live):
            vals = [c["peers"].get(n, {}).get("ratio") or 0 for c in rows]
            ax.barh(y + i * h, vals, height=h, label=f"vs {n}")
            _bar_labels(ax, list(y + i * h), vals)
        ax.set_yticks(y + h * (len(live) - 1) / 2)
        ax.set_yticklabels([_case_label(c) for c in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_xlabel("peer time / our time (> 1: we are faster; log scale)")
        ax.legend(fontsize=7)
    else:
        why = "; ".join(f"{n}: {doc['peers'][n].get('reason') or 'no comparable case'}"
                        for n in names) or "no GPU peer was requested"
        _empty(ax, f"no GPU peer measured:\n{why}")
    ax.set_title(_title(doc, "Ours against each GPU peer, largest size per operation"),
                 fontsize=9)
    return _save(fig, path)


def transfers_chart(doc: Dict[str, Any], path: str) -> str:
    fig = _figure(8, 4.5)
    ax = fig.add_subplot(111)
    series: Dict[str, List[Tuple[int, float]]] = {}
    for c in doc["cases"]:
        if c["family"] == "transfers" and c.get("gbps"):
            series.setdefault(_label(c), []).append((c["size"], c["gbps"]))
    if series:
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per copy")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=7)
    else:
        _empty(ax, "no copy was measured")
    ax.set_title(_title(doc, "Copies: achieved GB/s against size"), fontsize=9)
    return _save(fig, path)


def make_charts(doc: Dict[str, Any], out_dir: str) -> Tuple[List[str], Optional[str]]:
    """Write every chart; returns (file names written, error or None)."""
    try:  # Figure + FigureCanvasAgg: no pyplot, so the caller's backend is left alone
        importlib.import_module("matplotlib.backends.backend_agg")
    except Exception as exc:  # matplotlib is a dependency, but a broken install must not
        return [], f"matplotlib unavailable ({type(exc).__name__}: {exc}): no charts"
    written, errors = [], []
    for fn, name in ((speedup_chart, "speedup.png"), (bandwidth_chart, "bandwidth.png"),
                     (roofline_chart, "roofline.png"), (peers_chart, "peers.png"),
                     (transfers_chart, "transfers.png")):
        try:
            written.append(fn(doc, os.path.join(out_dir, name)))
        except Exception as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    return written, ("; ".join(errors) or None)
