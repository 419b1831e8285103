"""The report as text: summary.md, index.html and the terminal table, built from one table
model (`tables(doc)`), so all three show the same numbers.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

FAMILY_TITLES = {"vector": "Vector operations", "matrix": "Matrix operations",
                 "ml": "ML operations (CudaML)", "transfers": "Copies, pool and launch"}
GPU_PEER_COLUMNS = ("torch", "cupy")
HOW_TO_READ = (
    "median ms and p20-p80 ms: our time per call; CPU ms: the NumPy equivalent on this host; "
    "speed-up: CPU median / our median; GB/s: bytes the operation must move / median; "
    "of BW: GB/s over the measured copy bandwidth; of peak: GFLOP/s over the compute "
    "ceiling of the case (fp32, tf32_tensor, ...); max rel err: max|ours - ref| / max|ref| "
    "against float64 NumPy; vs peer: peer median / our median (> 1: we are faster).")


@dataclass
class Table:
    title: str
    headers: List[str]
    rows: List[List[str]]
    note: Optional[str] = None
    failed_rows: List[int] = field(default_factory=list)


def _num(x: Optional[float], fmt: str = ".4g") -> str:
    return "" if x is None else format(x, fmt)


def _pct(x: Optional[float]) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def _ratio(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.2f}x"


def _peer(c: Dict[str, Any], name: str) -> str:
    p = c["peers"].get(name)
    if not p:
        return ""
    if "ratio" in p:
        return _ratio(p["ratio"])
    return "error" if "error" in p else "-"


def _size(c: Dict[str, Any]) -> str:
    if c["family"] == "transfers" and c["op"].startswith("copy"):
        n = c["size"]
        return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1024 else f"{n} B"
    if c["shapes"]:
        return ", ".join("x".join(str(d) for d in s) for s in c["shapes"][:2])
    return str(c["size"])


def case_table(family: str, cases: List[Dict[str, Any]], peer_names: List[str]) -> Table:
    headers = ["op", "variant", "shape", "dtype", "median ms", "p20-p80 ms", "CPU ms",
               "speed-up", "GB/s", "GFLOP/s", "of BW", "of peak", "max rel err", "status"]
    headers += [f"vs {n}" for n in peer_names]
    rows, failed = [], []
    for c in cases:
        t, acc = c["time_ms"], c["accuracy"] or {}
        status = c["status"] if c["status"] != "skipped" else "skipped"
        rows.append([c["op"], c["variant"], _size(c), c["dtype"],
                     _num(t and t["median"]),
                     f"{t['p20']:.3g}-{t['p80']:.3g}" if t else "",
                     _num(c["cpu_time_ms"] and c["cpu_time_ms"]["median"]),
                     _ratio(c["speedup_vs_cpu"]), _num(c["gbps"], ".1f"),
                     _num(c["gflops"], ".1f"), _pct(c["fraction_of_bandwidth"]),
                     _pct(c["fraction_of_compute"]), _num(acc.get("max_rel_error"), ".1e"),
                     status.upper() if status == "failed" else status]
                    + [_peer(c, n) for n in peer_names])
        if c["status"] == "failed":
            failed.append(len(rows) - 1)
    note = "vs peer: '-' means skipped for this case (results.json says why)" \
        if peer_names else None
    return Table(FAMILY_TITLES[family], headers, rows, note, failed)


def tables(doc: Dict[str, Any]) -> List[Table]:
    """Overview, ceilings, failures, one table per family, skipped cases, coverage gaps."""
    out: List[Table] = []
    dev, ceil = doc["device"], doc["ceilings"]
    cc = ".".join(str(x) for x in dev["compute_capability"])
    counts = doc["counts"]
    if doc["fallback_mode"]:
        device = (f"{dev['name']}: {dev['multiprocessor_count']} CPU cores, "
                  f"{dev['memory_total'] / 2**30:.1f} GiB")
    else:
        device = (f"{dev['name']} (cc {cc}, {dev['multiprocessor_count']} SMs, "
                  f"{dev['memory_total'] / 2**30:.1f} GiB, L2 {dev['l2_cache_size'] >> 20} MiB)")
    overview = [
        ["device", device],
        ["cases", f"{counts['total']}: {counts['passed']} passed, {counts['failed']} failed, "
                  f"{counts['skipped']} skipped" + (" (INTERRUPTED)" if doc["interrupted"]
                                                    else "")],
        ["generated", f"{doc['generated_at']} in {doc.get('duration_s', 0):.1f} s"],
        ["git commit", doc["git_commit"] or "unknown"],
        ["versions", ", ".join(f"{k} {v}" for k, v in doc["versions"].items() if v)],
        ["timing", doc.get("timing", {}).get("description", "")],
        ["peers", ", ".join(f"{n} {p['version']}" if p["available"] else
                            f"{n}: skipped ({p['reason']})" for n, p in doc["peers"].items())],
    ]
    out.append(Table("Run", ["", ""], overview))
    if doc.get("warnings"):
        out.append(Table("WARNINGS", ["warning"], [[w] for w in doc["warnings"]],
                         failed_rows=list(range(len(doc["warnings"])))))
    bw = ceil["memory_bandwidth"]
    rows = [["memory bandwidth", _num(ceil["memory_bandwidth_gbps"], ".1f") + " GB/s",
             bw.get("method", "")]]
    for unit, p in ceil["compute"].items():
        rows.append([f"{unit} peak", _num(p["gflops"], ".0f") + (" GFLOP/s" if p["gflops"]
                                                                 else "n/a"), p["formula"]])
    out.append(Table("Ceilings", ["ceiling", "value", "how"], rows))
    failures = [c for c in doc["cases"] if c["status"] == "failed"]
    if failures:
        out.append(Table(f"FAILURES ({len(failures)})", ["case", "phase", "error"],
                         [[c["id"], c["phase"] or "", c["error"] or ""] for c in failures],
                         failed_rows=list(range(len(failures)))))
    peer_names = [n for n in GPU_PEER_COLUMNS if doc["peers"].get(n, {}).get("available")]
    for fam in FAMILY_TITLES:
        cases = [c for c in doc["cases"] if c["family"] == fam and c["status"] != "skipped"]
        if cases:
            out.append(case_table(fam, cases, peer_names))
    skipped = [c for c in doc["cases"] if c["status"] == "skipped"]
    if skipped:
        out.append(Table("Skipped", ["case", "reason"], [[c["id"], c["reason"] or ""]
                                                         for c in skipped]))
    gaps = [[op, v] for op, v in doc["coverage"].items() if isinstance(v, str)]
    if gaps:
        out.append(Table("Coverage notes", ["operation", "note"], gaps))
    return out


# -- markdown ----------------------------------------------------------------------------
def _md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def to_markdown(doc: Dict[str, Any], charts: List[str]) -> str:
    lines = ["# cuda-backend performance report", ""]
    if doc["banner"]:
        lines += [f"> **{doc['banner']}**", ""]
    lines += [f"_{HOW_TO_READ}_", ""]
    for t in tables(doc):
        lines += [f"## {t.title}", ""]
        lines.append("| " + " | ".join(_md_cell(h) for h in t.headers) + " |")
        lines.append("|" + "|".join("---" for _ in t.headers) + "|")
        for i, r in enumerate(t.rows):
            cells = [_md_cell(x) for x in r]
            if i in t.failed_rows:
                cells[0] = f"**{cells[0]}**"
            lines.append("| " + " | ".join(cells) + " |")
        if t.note:
            lines += ["", f"_{t.note}_"]
        lines.append("")
    if charts:
        lines += ["## Charts", ""]
        lines += [f"![{c}]({c})\n" for c in charts]
    return "\n".join(lines)


# -- html ----------------------------------------------------------------------------------
CSS = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}"
       "table{border-collapse:collapse;margin-bottom:1.5em;font-size:13px}"
       "td,th{border:1px solid #ccc;padding:3px 7px;text-align:left}"
       "th{background:#f3f3f3}tr.failed{background:#fdd}"
       ".banner{background:#fff3cd;border:2px solid #e0a800;padding:1em;font-weight:bold}"
       "img{max-width:100%;border:1px solid #ddd;margin-bottom:1em}")


def to_html(doc: Dict[str, Any], charts: List[str]) -> str:
    e = html.escape
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'>",
             "<title>cuda-backend performance report</title>", f"<style>{CSS}</style>",
             "</head><body><h1>cuda-backend performance report</h1>"]
    if doc["banner"]:
        parts.append(f"<p class='banner'>{e(doc['banner'])}</p>")
    parts.append(f"<p><i>{e(HOW_TO_READ)}</i></p>")
    for t in tables(doc):
        parts.append(f"<h2>{e(t.title)}</h2><table><tr>"
                     + "".join(f"<th>{e(h)}</th>" for h in t.headers) + "</tr>")
        for i, r in enumerate(t.rows):
            cls = " class='failed'" if i in t.failed_rows else ""
            parts.append(f"<tr{cls}>" + "".join(f"<td>{e(x)}</td>" for x in r) + "</tr>")
        parts.append("</table>")
        if t.note:
            parts.append(f"<p><i>{e(t.note)}</i></p>")
    if charts:
        parts.append("<h2>Charts</h2>")
        parts += [f"<p><img src='{e(c)}' alt='{e(c)}'></p>" for c in charts]
    parts.append("</body></html>")
    return "\n".join(parts)


# -- terminal ------------------------------------------------------------------------------
def to_text(doc: Dict[str, Any]) -> str:
    lines: List[str] = []
    if doc["banner"]:
        bar = "!" * min(100, len(doc["banner"]) + 4)
        lines += [bar, f"! {doc['banner']}", bar, ""]
    for t in tables(doc):
        widths = [max(len(h), *(len(r[i]) for r in t.rows)) if t.rows else len(h)
                  for i, h in enumerate(t.headers)]
        lines.append(f"== {t.title} ==")
        if any(t.headers):
            lines.append("  ".join(h.ljust(w) for h, w in zip(t.headers, widths)).rstrip())
        for r in t.rows:
            lines.append("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
        if t.note:
            lines.append(f"({t.note})")
        lines.append("")
    lines.append(HOW_TO_READ)
    return "\n".join(lines)
