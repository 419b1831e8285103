"""The report as text: summary.md, index.html and the terminal table, built from one table
model (`tables(doc)`), so all three show the same numbers.

The terminal version fits `width` columns (100 by default): columns with the same value in
every row become one line under the title, long variant and shape cells are shortened, and
the least important columns are left out (named under the table; summary.md keeps them).
"""
from __future__ import annotations

import html
import textwrap
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

FAMILY_TITLES = {"vector": "Vector operations", "matrix": "Matrix operations",
                 "ml": "ML operations (CudaML)", "transfers": "Copies, pool and launch",
                 "training": "Training steps (nn, autograd, optim)"}
GPU_PEER_COLUMNS = ("torch", "cupy")
TERMINAL_WIDTH = 100

# What each column of the case tables means; a legend lists the columns its tables show.
LEGEND = {
    "shape": "the inputs' shapes; 2×4096 is two inputs of 4096 elements, 2×(64x64) two 64x64 "
             "matrices",
    "median ms": "our time per call (median)",
    "p20-p80 ms": "the 20th to 80th percentile of our time",
    "CPU ms": "the NumPy equivalent on this host (median)",
    "speed-up": "CPU median / our median",
    "GB/s": "bytes the operation must move / our median",
    "GFLOP/s": "floating-point operations / our median",
    "of BW": "GB/s over the measured copy bandwidth (n/a in fallback mode: host caches make "
             "it meaningless)",
    "of peak": "GFLOP/s over the compute ceiling of the case (fp32, tf32_tensor, ...)",
    "max rel err": "max|ours - ref| / max|ref| against float64 NumPy",
    "vs torch": "PyTorch's median / ours (> 1: we are faster; '-': not run for this case, "
                "results.json says why)",
    "vs cupy": "CuPy's median / ours (> 1: we are faster; '-': not run for this case)",
}
# Terminal: the order in which columns are left out until a table fits.
# GB/s and GFLOP/s go before "of BW" and "of peak", which say the same against the ceilings.
DROP_ORDER = ("p20-p80 ms", "CPU ms", "speed-up", "GB/s", "GFLOP/s", "max rel err", "of peak")
# Terminal: columns moved under the table when every row that has a value has the same one
# (fallback mode's "n/a" of BW, one dtype, all passed), and the widest a cell of a column may
# be before it is shortened with an ellipsis.
CONSTANT_COLUMNS = ("variant", "dtype", "status", "of BW", "of peak")
BLANK_ALLOWED = ("of BW", "of peak")   # a blank cell here is "not applicable", not a value
MAX_CELL = {"variant": 15, "shape": 20, "op": 26}
CASE_COLUMNS = ("op", "variant", "shape", "dtype", "median ms", "p20-p80 ms", "CPU ms",
                "speed-up", "GB/s", "GFLOP/s", "of BW", "of peak", "max rel err", "status")


@dataclass
class Table:
    title: str
    headers: List[str]
    rows: List[List[str]]
    note: Optional[str] = None
    failed_rows: List[int] = field(default_factory=list)
    is_cases: bool = False
    folded: List[str] = field(default_factory=list)   # columns the note gives for every row


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


def format_shape(shape: Sequence[int]) -> str:
    """(64, 64) -> '64x64'; () -> 'scalar'."""
    return "x".join(str(int(d)) for d in shape) if len(shape) else "scalar"


def format_shapes(shapes: Sequence[Sequence[int]]) -> str:
    """The inputs' shapes, runs of equal shapes counted: [[4096], [4096]] -> '2×4096',
    [[64, 64], [64, 64]] -> '2×(64x64)', [[128, 256], [256]] -> '128x256, 256'."""
    parts: List[str] = []
    i = 0
    while i < len(shapes):
        j = i
        while j + 1 < len(shapes) and list(shapes[j + 1]) == list(shapes[i]):
            j += 1
        text, n = format_shape(shapes[i]), j - i + 1
        if n > 1:
            text = f"{n}×{text}" if len(shapes[i]) <= 1 else f"{n}×({text})"
        parts.append(text)
        i = j + 1
    return ", ".join(parts)


def case_size(c: Dict[str, Any]) -> str:
    """The 'shape' cell of a case: bytes for copies, else its input shapes (else its size)."""
    if c["family"] == "transfers" and c["op"].startswith("copy"):
        n = c["size"]
        return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1024 else f"{n} B"
    if c["shapes"]:
        return format_shapes(c["shapes"])
    return str(c["size"])


def _drop_empty_columns(t: Table, keep: Sequence[str] = ("op",)) -> Table:
    """The table without the columns that are empty in every row."""
    cols = [i for i, h in enumerate(t.headers) if h in keep or any(r[i] for r in t.rows)]
    return Table(t.title, [t.headers[i] for i in cols], [[r[i] for i in cols] for r in t.rows],
                 t.note, t.failed_rows, t.is_cases)


def case_table(family: str, cases: List[Dict[str, Any]], peer_names: List[str],
               fallback: bool = False) -> Table:
    """One family's cases; columns empty in every row are left out."""
    headers = list(CASE_COLUMNS) + [f"vs {n}" for n in peer_names]
    rows, failed = [], []
    for c in cases:
        t, acc = c["time_ms"], c["accuracy"] or {}
        status = c["status"]
        of_bw = "n/a" if fallback and c.get("gbps") else _pct(c["fraction_of_bandwidth"])
        rows.append([c["op"], c["variant"], case_size(c), c["dtype"],
                     _num(t and t["median"]),
                     f"{t['p20']:.3g}-{t['p80']:.3g}" if t else "",
                     _num(c["cpu_time_ms"] and c["cpu_time_ms"]["median"]),
                     _ratio(c["speedup_vs_cpu"]), _num(c["gbps"], ".1f"),
                     _num(c["gflops"], ".1f"), of_bw,
                     _pct(c["fraction_of_compute"]), _num(acc.get("max_rel_error"), ".1e"),
                     status.upper() if status == "failed" else status]
                    + [_peer(c, n) for n in peer_names])
        if c["status"] == "failed":
            failed.append(len(rows) - 1)
    return _drop_empty_columns(Table(FAMILY_TITLES[family], headers, rows, None, failed,
                                     is_cases=True))


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
            out.append(case_table(fam, cases, peer_names, bool(doc["fallback_mode"])))
    skipped = [c for c in doc["cases"] if c["status"] == "skipped"]
    if skipped:
        out.append(Table("Skipped", ["case", "reason"], [[c["id"], c["reason"] or ""]
                                                         for c in skipped]))
    gaps = [[op, v] for op, v in doc["coverage"].items() if isinstance(v, str)]
    if gaps:
        out.append(Table("Coverage notes", ["operation", "note"], gaps))
    return out


def legend(shown: Sequence[Table]) -> str:
    """How to read the columns that these tables show (and only those)."""
    headers = {h for t in shown if t.is_cases for h in t.headers + t.folded}
    parts = [f"{h}: {text}" for h, text in LEGEND.items() if h in headers]
    return "; ".join(parts) + "." if parts else ""


def output_links(doc: Dict[str, Any]) -> List[List[str]]:
    """[file, what it is] for the report's data files that were written (not the charts)."""
    files = set((doc.get("outputs") or {}).get("files") or [])
    what = [
        ("results.json", "every number of this report, one record per case"),
        ("results.schema.json", "the JSON Schema of results.json"),
        ("summary.md", "these tables in Markdown"),
        ("profile_stats.json", "per-kernel and per-copy timing totals and the pools' statistics"),
        ("trace.json", "a Chrome trace of every launch and copy: open it in "
                       "https://ui.perfetto.dev (Open trace file) or in Chrome at "
                       "chrome://tracing (Load)"),
    ]
    return [[name, text] for name, text in what if name in files]


# -- markdown ----------------------------------------------------------------------------
def _md_cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def to_markdown(doc: Dict[str, Any], charts: List[str]) -> str:
    lines = ["# cuda-backend performance report", ""]
    if doc["banner"]:
        lines += [f"> **{doc['banner']}**", ""]
    all_tables = tables(doc)
    how = legend(all_tables)
    if how:
        lines += [f"_{how}_", ""]
    for t in all_tables:
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
    links = [[n, w] for n, w in output_links(doc) if n != "summary.md"]
    if links:
        lines += ["## Files", ""]
        lines += [f"- [`{n}`]({n}): {w}" for n, w in links]
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
    all_tables = tables(doc)
    links = output_links(doc)
    if links:
        parts.append("<p>Files: " + " · ".join(
            f"<a href='{e(n)}'>{e(n)}</a>" for n, _ in links) + "</p>")
    how = legend(all_tables)
    if how:
        parts.append(f"<p><i>{e(how)}</i></p>")
    for t in all_tables:
        parts.append(f"<h2>{e(t.title)}</h2><table><tr>"
                     + "".join(f"<th>{e(h)}</th>" for h in t.headers) + "</tr>")
        for i, r in enumerate(t.rows):
            cls = " class='failed'" if i in t.failed_rows else ""
            parts.append(f"<tr{cls}>" + "".join(f"<td>{e(x)}</td>" for x in r) + "</tr>")
        parts.append("</table>")
        if t.note:
            parts.append(f"<p><i>{e(t.note)}</i></p>")
    if links:
        parts.append("<h2>Files</h2><ul>")
        parts += [f"<li><a href='{e(n)}'>{e(n)}</a>: {e(w)}</li>" for n, w in links]
        parts.append("</ul>")
    if charts:
        parts.append("<h2>Charts</h2>")
        parts += [f"<p><img src='{e(c)}' alt='{e(c)}'></p>" for c in charts]
    parts.append("</body></html>")
    return "\n".join(parts)


# -- terminal ------------------------------------------------------------------------------
def _shorten(s: str, width: int) -> str:
    return s if len(s) <= width else s[:width - 1] + "…"


def _row_width(widths: Sequence[int]) -> int:
    return sum(widths) + 2 * (len(widths) - 1)


def fit_table(t: Table, width: int = TERMINAL_WIDTH) -> Table:
    """A case table that fits `width` columns: constant columns moved into the note, long
    cells shortened, then columns left out in DROP_ORDER (named in the note)."""
    headers, rows = list(t.headers), [list(r) for r in t.rows]
    notes: List[str] = []
    folded: List[str] = []
    if len(rows) > 1:
        values = {h: {r[headers.index(h)] for r in rows}
                  - ({""} if h in BLANK_ALLOWED else set())
                  for h in CONSTANT_COLUMNS if h in headers}
        same = [h for h, v in values.items() if len(v) == 1]
        notes += [f"{h} {next(iter(values[h]))}" for h in same if next(iter(values[h]))]
        folded += same
        keep = [i for i, h in enumerate(headers) if h not in same]
        headers, rows = [headers[i] for i in keep], [[r[i] for i in keep] for r in rows]
    def shorten(limits: Dict[str, int]) -> None:
        for i, h in enumerate(headers):
            if h in limits:
                for r in rows:
                    r[i] = _shorten(r[i], limits[h])

    def too_wide() -> bool:
        widths = [max(len(x) for x in [hd] + [r[i] for r in rows])
                  for i, hd in enumerate(headers)]
        return _row_width(widths) > width

    shorten(MAX_CELL)
    dropped: List[str] = []
    for h in DROP_ORDER:
        if not too_wide():
            break
        if h in headers:
            i = headers.index(h)
            headers.pop(i)
            for r in rows:
                r.pop(i)
            dropped.append(h)
    squeeze = 1
    while too_wide() and squeeze <= 8:   # last resort: narrower variant and shape cells
        shorten({"variant": MAX_CELL["variant"] - squeeze, "shape": MAX_CELL["shape"] - squeeze})
        squeeze += 1
    note = "; ".join(filter(None, [
        ("every row: " + ", ".join(notes)) if notes else "",
        (f"left out to fit {width} columns: {', '.join(dropped)} (summary.md has them)"
         if dropped else ""),
        t.note or ""]))
    return Table(t.title, headers, rows, note or None, t.failed_rows, t.is_cases, folded)


def _wrap_rows(t: Table, width: int) -> List[str]:
    """A table whose last column is free text (Run, Ceilings, Skipped...): that column
    wrapped under itself so every line fits `width`."""
    lead = [max([len(t.headers[i])] + [len(r[i]) for r in t.rows])
            for i in range(len(t.headers) - 1)]
    indent = _row_width(lead) + 2 if lead else 0
    room = max(20, width - indent)
    lines = []
    rows = ([t.headers] if any(t.headers) else []) + t.rows
    for r in rows:
        head = "  ".join(x.ljust(w) for x, w in zip(r, lead))
        pieces = textwrap.wrap(r[-1], room, break_on_hyphens=False) or [""]
        first = (head + "  " if lead else "") + pieces[0]
        lines.append(first.rstrip())
        lines += [" " * indent + p for p in pieces[1:]]
    return lines


def to_text(doc: Dict[str, Any], width: int = TERMINAL_WIDTH) -> str:
    """The tables for a terminal, every line at most `width` characters."""
    lines: List[str] = []
    if doc["banner"]:
        body = textwrap.wrap(doc["banner"], width - 2)
        bar = "!" * min(width, max(len(b) for b in body) + 2)
        lines += [bar] + [f"! {b}" for b in body] + [bar, ""]
    shown: List[Table] = []
    for t in tables(doc):
        lines.append(f"== {t.title} ==")
        if t.is_cases:
            t = fit_table(t, width)
            shown.append(t)
            widths = [max(len(h), *(len(r[i]) for r in t.rows)) if t.rows else len(h)
                      for i, h in enumerate(t.headers)]
            lines.append("  ".join(h.ljust(w) for h, w in zip(t.headers, widths)).rstrip())
            for r in t.rows:
                lines.append("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
        else:
            lines += _wrap_rows(t, width)
        if t.note:
            lines += textwrap.wrap(f"({t.note})", width)
        lines.append("")
    how = legend(shown)
    if how:
        lines += textwrap.wrap(how, width)
    return "\n".join(lines)
