"""README.md of a reports folder (`reports/` by default): one row per device report found
under it, its numbers read from that report's results.json, so the README cannot go stale.
`cuda-backend report` rewrites it after each run; `python -m
cuda_backend.performance.reports_readme [DIR]` rewrites it alone.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional


def _load(path: Path) -> Optional[Dict[str, Any]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and "device" in doc and "counts" in doc else None


def _row(folder: str, doc: Dict[str, Any]) -> str:
    counts = doc["counts"]
    cases = (f"{counts.get('total', 0)}: {counts.get('passed', 0)} passed, "
             f"{counts.get('failed', 0)} failed, {counts.get('skipped', 0)} skipped")
    if doc.get("interrupted"):
        cases += " (interrupted)"
    bw = (doc.get("ceilings") or {}).get("memory_bandwidth_gbps")
    mode = "fallback (no GPU)" if doc.get("fallback_mode") else "GPU"
    quick = "quick" if (doc.get("configuration") or {}).get("quick") else "full"
    commit = (doc.get("git_commit") or "unknown")[:12]
    return (f"| [`{folder}/`]({folder}/summary.md) | {doc['device'].get('name', '?')} | {mode}, "
            f"{quick} | {doc.get('generated_at', '?')} | `{commit}` | {cases} | "
            f"{f'{bw:.0f} GB/s' if bw else 'n/a'} |")


def render_readme(root: Path) -> str:
    """The README text for the reports under `root` (each `root/<slug>/results.json`)."""
    rows: List[str] = []
    for path in sorted(Path(root).glob("*/results.json")):
        doc = _load(path)
        if doc is not None:
            rows.append(_row(path.parent.name, doc))
    lines = [
        "# Reports", "",
        "`cuda-backend report` writes one folder per device here (`<device-slug>/`): "
        "`results.json` (schema in `results.schema.json`), the charts, `summary.md` and "
        "`index.html` (with `--profile` also `profile_stats.json` and `trace.json`, a Chrome "
        "trace for https://ui.perfetto.dev or chrome://tracing).", "",
        "This file is rewritten after each run from the `results.json` files below "
        "(`cuda_backend/performance/reports_readme.py`); edit that, not this file.", "",
    ]
    if rows:
        lines += ["| report | device | mode | generated | commit | cases | measured copy "
                  "bandwidth |", "|---|---|---|---|---|---|---|"] + rows
    else:
        lines.append("No report has been written here yet.")
    return "\n".join(lines) + "\n"


def write_readme(root: Path) -> Path:
    """Write `root/README.md` (atomically) and return its path."""
    root = Path(root)
    path = root / "README.md"
    tmp = root / ".README.md.tmp"
    tmp.write_text(render_readme(root), encoding="utf-8")
    tmp.replace(path)
    return path


if __name__ == "__main__":
    print(write_readme(Path(sys.argv[1] if len(sys.argv) > 1 else "reports")))
