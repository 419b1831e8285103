"""Before/after: the cases two reports share, side by side (`cuda-backend compare OLD NEW`, and
`cuda-backend report --compare OLD` after its run, in the terminal and in summary.md).

Each case passed in both results.json files (matched by id, family/op[variant]/size/dtype)
gets one row: ours' median time in both runs, PyTorch's median over ours (the report's
"vs torch") in both, and their quotient new/old (> 1: the new run is relatively faster).
Where either run has no PyTorch ratio for the case (no PyTorch, fallback mode, a skipped
peer), the row compares ours' medians instead, old/new (basis "time": meaningful only between
runs on one machine).
Noise: a timing's p20-p80 spread is (p80 - p20) / median, a row's noise is the sum of the
spreads of the timings behind its quotient (ours and PyTorch's, in both runs), and a row is
flagged WORSE when new/old < 1 / (1 + noise) (better when new/old > 1 + noise).
Cases in one file only, or not passed in one of them, are counted and listed by id.
"""
from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from .schema import SCHEMA_VERSION

TERMINAL_WIDTH = 100
PEER = "torch"
HEADERS = ("case", "old ms", "new ms", "old vs torch", "new vs torch", "new/old", "noise",
           "basis", "flag")


class ResultsFileError(ValueError):
    """A results.json that cannot be compared; the message names the file and what is
    missing or wrong."""

    def __init__(self, path: Union[str, Path], problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = str(path), problem


@dataclass
class Row:
    """One case passed in both runs."""

    id: str
    old_ms: float
    new_ms: float
    old_ratio: Optional[float]     # PyTorch's median / ours, None when not timed
    new_ratio: Optional[float]
    basis: str                     # "torch": ratios compared; "time": ours' medians
    quotient: float                # new/old: > 1 means the new run is better
    noise: float                   # the sum of the spreads behind the quotient

    @property
    def flag(self) -> str:
        if self.quotient * (1.0 + self.noise) < 1.0:
            return "WORSE"
        return "better" if self.quotient > 1.0 + self.noise else ""


@dataclass
class Comparison:
    """Every case of two runs: compared rows, and the ids that could not be compared."""

    rows: List[Row] = field(default_factory=list)
    only_old: List[str] = field(default_factory=list)
    only_new: List[str] = field(default_factory=list)
    not_compared: List[Tuple[str, str]] = field(default_factory=list)   # (id, why)

    @property
    def worse(self) -> List[Row]:
        return [r for r in self.rows if r.flag == "WORSE"]

    @property
    def better(self) -> List[Row]:
        return [r for r in self.rows if r.flag == "better"]


# -- reading -----------------------------------------------------------------------------
def load_results(path: Union[str, Path]) -> Dict[str, Any]:
    """A report's results.json (or the folder holding it), checked for what a comparison
    reads; ResultsFileError otherwise."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    if not p.is_file():
        raise ResultsFileError(p, "no such file (give a results.json or the report folder "
                                  "holding one)")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultsFileError(p, f"not readable as JSON ({exc})") from exc
    check_results(doc, p)
    return doc


def check_results(doc: Any, path: Union[str, Path]) -> None:
    """What compare() reads, present and well typed: ResultsFileError naming the first
    thing missing."""
    if not isinstance(doc, dict):
        raise ResultsFileError(path, f"the top level is a JSON {type(doc).__name__}, not the "
                                     f"object of a cuda-backend results.json")
    version = doc.get("schema_version")
    if not isinstance(version, str):
        raise ResultsFileError(path, "no 'schema_version' (not a cuda-backend results.json?)")
    if version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        raise ResultsFileError(path, f"schema_version {version}: this version reads "
                                     f"{SCHEMA_VERSION.split('.')[0]}.x")
    cases = doc.get("cases")
    if not isinstance(cases, list):
        raise ResultsFileError(path, "no 'cases' list")
    seen = set()
    for i, case in enumerate(cases):
        if not isinstance(case, dict) or not isinstance(case.get("id"), str):
            raise ResultsFileError(path, f"cases[{i}] has no 'id'")
        where = f"cases[{i}] ({case['id']})"
        if case["id"] in seen:
            raise ResultsFileError(path, f"{where}: the id appears twice")
        seen.add(case["id"])
        if not isinstance(case.get("status"), str):
            raise ResultsFileError(path, f"{where} has no 'status'")
        if case["status"] != "passed":
            continue
        _check_stats(case.get("time_ms"), path, f"{where}.time_ms")
        peer = (case.get("peers") or {}).get(PEER) or {}
        if peer.get("ratio") is not None:
            _check_stats(peer.get("time_ms"), path, f"{where}.peers.{PEER}.time_ms")


def _check_stats(stats: Any, path: Union[str, Path], where: str) -> None:
    if not isinstance(stats, dict):
        raise ResultsFileError(path, f"{where} is missing")
    for key in ("median", "p20", "p80"):
        value = stats.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ResultsFileError(path, f"{where}.{key} is missing (or not a number >= 0)")


# -- comparing ---------------------------------------------------------------------------
def spread(stats: Dict[str, Any]) -> float:
    """(p80 - p20) / median: the relative p20-p80 spread of one timing."""
    return (stats["p80"] - stats["p20"]) / stats["median"]


def _ratio(case: Dict[str, Any]) -> Optional[float]:
    return ((case.get("peers") or {}).get(PEER) or {}).get("ratio")


def compare_row(old: Dict[str, Any], new: Dict[str, Any]) -> Row:
    """The row of one case passed in both runs (both medians > 0)."""
    t_old, t_new = old["time_ms"], new["time_ms"]
    noise = spread(t_old) + spread(t_new)
    r_old, r_new = _ratio(old), _ratio(new)
    if r_old and r_new:
        noise += spread(old["peers"][PEER]["time_ms"]) + spread(new["peers"][PEER]["time_ms"])
        return Row(new["id"], t_old["median"], t_new["median"], r_old, r_new, "torch",
                   r_new / r_old, noise)
    return Row(new["id"], t_old["median"], t_new["median"], r_old, r_new, "time",
               t_old["median"] / t_new["median"], noise)


def compare(old_doc: Dict[str, Any], new_doc: Dict[str, Any]) -> Comparison:
    """Every case of the new run against the old one, in the new run's order."""
    old = {c["id"]: c for c in old_doc["cases"]}
    new_ids = {c["id"] for c in new_doc["cases"]}
    out = Comparison(only_old=[i for i in old if i not in new_ids])
    for case in new_doc["cases"]:
        before = old.get(case["id"])
        if before is None:
            out.only_new.append(case["id"])
            continue
        why = _not_comparable(before, case)
        if why:
            out.not_compared.append((case["id"], why))
        else:
            out.rows.append(compare_row(before, case))
    return out


def _not_comparable(old: Dict[str, Any], new: Dict[str, Any]) -> Optional[str]:
    for run, case in (("old", old), ("new", new)):
        if case["status"] != "passed":
            return f"{case['status']} in the {run} run"
        if case["time_ms"]["median"] <= 0:
            return f"ours' median is 0 in the {run} run"
    return None


# -- writing -----------------------------------------------------------------------------
def _cells(r: Row) -> List[str]:
    def ratio(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.2f}x"
    return [r.id, f"{r.old_ms:.4g}", f"{r.new_ms:.4g}", ratio(r.old_ratio), ratio(r.new_ratio),
            f"{r.quotient:.3f}", f"{100 * r.noise:.0f}%", r.basis, r.flag]


def describe(doc: Dict[str, Any], label: str) -> str:
    """'label: device, commit, time' of one run."""
    device = (doc.get("device") or {}).get("name", "unknown device")
    mode = " (fallback mode)" if doc.get("fallback_mode") else ""
    return (f"{label}: {device}{mode}, commit {doc.get('git_commit') or 'unknown'}, "
            f"{doc.get('generated_at', 'unknown time')}")


def summary_line(c: Comparison) -> str:
    return (f"{len(c.rows)} case{'' if len(c.rows) == 1 else 's'} in both runs: "
            f"{len(c.worse)} WORSE beyond the noise, "
            f"{len(c.better)} better, {len(c.rows) - len(c.worse) - len(c.better)} within it; "
            f"{len(c.only_old)} only in the old run, {len(c.only_new)} only in the new one, "
            f"{len(c.not_compared)} not passed in one of them")


def _leftovers(c: Comparison) -> List[Tuple[str, List[str]]]:
    return [("only in the old run", c.only_old), ("only in the new run", c.only_new),
            ("not compared", [f"{i} ({why})" for i, why in c.not_compared])]


RULE = ("old ms, new ms: our median in each run; vs torch: PyTorch's median / ours. new/old: "
        "the new vs-torch ratio over the old one (basis torch), or our old median over the new "
        "one (basis time); > 1 is better. noise: the p20-p80 spreads (p80 - p20) / median of "
        "the timings behind it, added; WORSE: new/old < 1 / (1 + noise).")


def to_markdown(c: Comparison, old_label: str, new_label: str) -> str:
    """The comparison as a summary.md section."""
    lines = ["## Compared with an earlier run", "", f"- {old_label}", f"- {new_label}", "",
             f"_{summary_line(c)}. {RULE}_", ""]
    if c.rows:
        lines.append("| " + " | ".join(HEADERS) + " |")
        lines.append("|" + "|".join("---" for _ in HEADERS) + "|")
        for r in c.rows:
            cells = [x.replace("|", "\\|") for x in _cells(r)]
            if r.flag == "WORSE":
                cells[0] = f"**{cells[0]}**"
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for title, ids in _leftovers(c):
        if ids:
            lines += [f"{title}: " + ", ".join(f"`{i}`" for i in ids), ""]
    return "\n".join(lines)


def to_text(c: Comparison, old_label: str, new_label: str,
            width: int = TERMINAL_WIDTH) -> str:
    """The comparison for a terminal, every line at most `width` characters: a case id too
    long for its column gets a line of its own, its numbers on the next."""
    rows = [list(HEADERS)] + [_cells(r) for r in c.rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADERS))]
    widths[0] = min(widths[0], max(width - sum(widths[1:]) - 2 * (len(HEADERS) - 1), 4))
    lines = ["== Compared with an earlier run ==", old_label, new_label]
    lines += textwrap.wrap(summary_line(c), width)
    for r in rows if c.rows else []:
        if len(r[0]) > widths[0]:
            lines.append(r[0])
            r = [""] + r[1:]
        lines.append("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
    for title, ids in _leftovers(c):
        if ids:
            lines += textwrap.wrap(f"{title}: " + ", ".join(ids), width)
    lines += textwrap.wrap(RULE, width)
    return "\n".join(lines)


def append_to_summary(folder: Union[str, Path], markdown: str) -> Path:
    """Add the comparison section to the end of folder/summary.md."""
    path = Path(folder) / "summary.md"
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n" + markdown + "\n")
    return path
