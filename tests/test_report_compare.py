"""Before/after reports (cuda_backend/performance/compare.py): `cuda-backend compare OLD NEW`
and `cuda-backend report --compare OLD`, on synthetic results.json files: which cases are
matched, which are left over, the noise rule that flags a case WORSE, and bad files (a
ResultsFileError naming the file and what is missing)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cuda_backend import cli
from cuda_backend.driver import load_driver
from cuda_backend.performance import compare as cmp
from cuda_backend.performance import schema

fallback_only = pytest.mark.skipif(load_driver()[0] is not None,
                                   reason="in-process fallback run; on a GPU test_report.py's "
                                          "subprocess runs cover the report")


def stats(median: float, spread: float) -> dict:
    """Timing statistics whose p20-p80 spread is `spread` of the median."""
    half = median * spread / 2
    return {"median": median, "mean": median, "min": median - half, "max": median + half,
            "p20": median - half, "p80": median + half, "count": 5}


def case(case_id: str, ours: float = 1.0, torch: float = None, spread: float = 0.02,
         status: str = "passed") -> dict:
    c = {"id": case_id, "status": status, "peers": {},
         "time_ms": stats(ours, spread) if status == "passed" else None}
    if torch is not None:
        c["peers"]["torch"] = {"time_ms": stats(torch, spread), "ratio": torch / ours}
    return c


def doc(*cases: dict) -> dict:
    return {"schema_version": schema.SCHEMA_VERSION, "generated_at": "2026-01-01T00:00:00",
            "device": {"name": "Test GPU"}, "git_commit": "abc1234", "fallback_mode": False,
            "cases": list(cases)}


def write(path: Path, content) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


# -- matching --------------------------------------------------------------------------
def test_cases_in_both_runs_are_matched_in_the_new_runs_order():
    old = doc(case("a", torch=1.0), case("b", torch=1.0), case("c"))
    new = doc(case("b", torch=1.0), case("d"), case("a", torch=1.0))
    c = cmp.compare(old, new)
    assert [r.id for r in c.rows] == ["b", "a"]
    assert c.only_old == ["c"] and c.only_new == ["d"] and c.not_compared == []
    assert "2 cases in both runs" in cmp.summary_line(c)
    assert "1 only in the old run, 1 only in the new one" in cmp.summary_line(c)


def test_cases_not_passed_in_a_run_are_listed_with_why():
    old = doc(case("a"), case("b", status="skipped"), case("c"))
    new = doc(case("a", status="failed"), case("b"), case("c"))
    c = cmp.compare(old, new)
    assert [r.id for r in c.rows] == ["c"]
    assert c.not_compared == [("a", "failed in the new run"), ("b", "skipped in the old run")]
    md = cmp.to_markdown(c, "old", "new")
    assert "not compared: `a (failed in the new run)`, `b (skipped in the old run)`" in md


# -- the noise rule ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "old, new, spread, flag, basis, quotient", [
        # PyTorch's ratio 1.0 -> 0.9; four spreads of 2 %: noise 8 %, 0.9 x 1.08 < 1
        ((1.0, 1.0), (1.0, 0.9), 0.02, "WORSE", "torch", 0.9),
        # the same drop inside four spreads of 5 %: noise 20 %, 0.9 x 1.2 > 1
        ((1.0, 1.0), (1.0, 0.9), 0.05, "", "torch", 0.9),
        # ours 10 % slower, PyTorch too: the ratio holds
        ((1.0, 1.0), (1.1, 1.1), 0.02, "", "torch", 1.0),
        # ratio 1.0 -> 1.2 beyond 8 % of noise
        ((1.0, 1.0), (1.0, 1.2), 0.02, "better", "torch", 1.2),
        # no PyTorch in the old run: ours' medians, old/new = 1/1.2, noise 4 %
        ((1.0, None), (1.2, 1.0), 0.02, "WORSE", "time", 1 / 1.2),
        ((1.0, None), (1.02, None), 0.02, "", "time", 1 / 1.02),
    ])
def test_noise_rule(old, new, spread, flag, basis, quotient):
    c = cmp.compare(doc(case("x", *old, spread=spread)), doc(case("x", *new, spread=spread)))
    (row,) = c.rows
    assert (row.flag, row.basis) == (flag, basis)
    assert row.quotient == pytest.approx(quotient)
    assert row.noise == pytest.approx((4 if basis == "torch" else 2) * spread)
    assert (c.worse == [row]) is (flag == "WORSE") and (c.better == [row]) is (flag == "better")


def test_spread_is_p20_to_p80_over_the_median():
    assert cmp.spread({"median": 2.0, "p20": 1.5, "p80": 2.5}) == 0.5


# -- bad files -------------------------------------------------------------------------------
def _bad(**changes):
    d = doc(case("vector/add/4096/float32", torch=1.0), case("vector/exp/4096/float32"))
    for key, value in changes.items():
        d[key] = value
    return d


def _case_without(path: str) -> dict:
    d = doc(case("a", torch=1.0))
    *parents, last = path.split(".")
    node = d["cases"][0]
    for p in parents:
        node = node[p]
    del node[last]
    return d


@pytest.mark.parametrize("content, problem", [
    ("{", "not readable as JSON"),
    ([1, 2], "the top level is a JSON list"),
    ({"cases": []}, "no 'schema_version'"),
    (_bad(schema_version="2.0.0"), "schema_version 2.0.0: this version reads 1.x"),
    (_bad(cases={"a": 1}), "no 'cases' list"),
    (_bad(cases=[case("a"), {"status": "passed"}]), "cases[1] has no 'id'"),
    (_bad(cases=[case("a"), case("a")]), "cases[1] (a): the id appears twice"),
    (_case_without("status"), "cases[0] (a) has no 'status'"),
    (_case_without("time_ms"), "cases[0] (a).time_ms is missing"),
    (_case_without("time_ms.p20"), "cases[0] (a).time_ms.p20 is missing"),
    (_case_without("peers.torch.time_ms"), "cases[0] (a).peers.torch.time_ms is missing"),
], ids=["not-json", "list", "no-version", "major-2", "no-cases", "no-id", "twice",
        "no-status", "no-time", "no-p20", "no-torch-time"])
def test_bad_files_name_the_file_and_what_is_missing(tmp_path, content, problem):
    path = write(tmp_path / "results.json", content)
    with pytest.raises(cmp.ResultsFileError) as exc:
        cmp.load_results(path)
    assert str(exc.value) == f"{path}: {exc.value.problem}"
    assert exc.value.problem.startswith(problem), exc.value.problem
    assert isinstance(exc.value, ValueError)       # `report` exits 2 on it


def test_missing_file_and_folder_without_results(tmp_path):
    with pytest.raises(cmp.ResultsFileError, match="nope.json: no such file"):
        cmp.load_results(tmp_path / "nope.json")
    with pytest.raises(cmp.ResultsFileError, match=r"results\.json: no such file"):
        cmp.load_results(tmp_path)
    write(tmp_path / "results.json", doc(case("a")))
    assert cmp.load_results(tmp_path)["cases"][0]["id"] == "a"    # the folder holding one


# -- output ------------------------------------------------------------------------------------
def test_terminal_table_fits_100_columns_and_markdown_keeps_whole_ids():
    long_id = "matrix/matrix_multiply[skinny (3,4n+1)@(4n+1,n)]/1000/float32"
    old = doc(case(long_id, torch=1.0), case("vector/add/4096/float32", torch=1.0))
    new = doc(case(long_id, torch=0.5), case("vector/add/4096/float32", torch=1.0))
    c = cmp.compare(old, new)
    text = cmp.to_text(c, "old: a", "new: b")
    assert all(len(line) <= 100 for line in text.splitlines()), text
    assert "WORSE" in text and "/1000/float32" in text
    md = cmp.to_markdown(c, "old: a", "new: b")
    assert f"| **{long_id}** |" in md and "| vector/add/4096/float32 |" in md
    assert "1 WORSE beyond the noise" in md


def test_compare_command_exit_statuses(tmp_path, capsys):
    old = write(tmp_path / "old.json", doc(case("a", torch=1.0), case("b", torch=1.0)))
    same = write(tmp_path / "same.json", doc(case("a", torch=1.0), case("b", torch=1.01)))
    worse = write(tmp_path / "worse.json", doc(case("a", torch=0.5), case("b", torch=1.0)))
    assert cli.main(["compare", str(old), str(same)]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert f"old ({old}): Test GPU, commit abc1234" in out and "0 WORSE" in out
    assert cli.main(["compare", str(old), str(worse)]) == cli.EXIT_CASE_FAILED
    assert "1 WORSE beyond the noise" in capsys.readouterr().out
    assert cli.main(["compare", str(old), str(tmp_path / "none.json")]) == cli.EXIT_USAGE
    assert f"cuda-backend compare: {tmp_path / 'none.json'}: no such file" in \
        capsys.readouterr().err


# -- report --compare OLD --------------------------------------------------------------------
def only_folder(out: Path) -> Path:
    (folder,) = [d for d in out.iterdir() if d.is_dir()]
    return folder


@fallback_only
def test_report_compare_prints_and_writes_the_table(tmp_path, capsys):
    run = ["report", "--quick", "--no-peers", "--sizes", "vector=1000", "--ops"]
    assert cli.main(run + ["vector_add", "exp", "--out", str(tmp_path / "a")]) == 0
    first = only_folder(tmp_path / "a")
    old = cmp.load_results(first)                   # a report's own results.json is readable
    assert old["cases"][0]["id"] == "vector/vector_add/1000/float32"
    capsys.readouterr()
    assert cli.main(run + ["vector_add", "--out", str(tmp_path / "b"),
                           "--compare", str(first)]) == 0
    out = capsys.readouterr().out
    assert "== Compared with an earlier run ==" in out and f"old ({first})" in out
    assert "1 case in both runs" in out and "1 only in the old run" in out
    md = (only_folder(tmp_path / "b") / "summary.md").read_text()
    assert "## Compared with an earlier run" in md
    # (the row is bold where the two fallback runs' timings differ beyond their noise: a
    # timing of this machine, so either form)
    assert re.search(r"\| (\*\*)?vector/vector_add/1000/float32(\*\*)? \|", md), md
    assert "`vector/exp/1000/float32`" in md


def test_report_compare_checks_old_before_running(tmp_path, capsys):
    bad = write(tmp_path / "old.json", {"cases": []})
    rc = cli.main(["report", "--quick", "--ops", "vector_add", "--out", str(tmp_path / "o"),
                   "--compare", str(bad)])
    assert rc == cli.EXIT_USAGE
    assert f"cuda-backend report: {bad}: no 'schema_version'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()                # nothing ran
