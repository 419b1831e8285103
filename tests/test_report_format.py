"""The report's text forms (cuda_backend/performance/render.py) on synthetic results: the
terminal version fits 100 columns whatever the names, shapes and peers; shapes are written
with repeated inputs counted (2×4096); the legend explains exactly the columns shown; in
fallback mode "of BW" is n/a, never a percentage; summary.md keeps every column; index.html
and summary.md link the data files and say how to open the trace; reports/README.md is
built from the results.json files under it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from cuda_backend.performance import render
from cuda_backend.performance.reports_readme import render_readme

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("shapes, text", [
    ([[4096], [4096]], "2×4096"),
    ([[64, 64], [64, 64]], "2×(64x64)"),
    ([[128, 256], [256]], "128x256, 256"),
    ([[8, 64, 16, 16], [64], [64], [64], [64]], "8x64x16x16, 4×64"),
    ([[3], [4], [3]], "3, 4, 3"),
    ([[2, 8, 128, 64]] * 3, "3×(2x8x128x64)"),
    ([[]], "scalar"),
    ([], ""),
])
def test_shapes_are_written_with_repeats_counted(shapes, text):
    assert render.format_shapes(shapes) == text


def test_case_size_of_copies_is_in_bytes():
    case = {"family": "transfers", "op": "copy_to_device", "size": 16 << 20, "shapes": [[1]]}
    assert render.case_size(case) == "16 MiB"
    assert render.case_size(dict(case, size=4096)) == "4 KiB"
    assert render.case_size(dict(case, op="allocate_memory", shapes=[])) == str(16 << 20)


# -- synthetic results ----------------------------------------------------------------------
def case(family: str, op: str, shapes: List[List[int]], variant: str = "", dtype: str = "float32",
         status: str = "passed", median: float = 0.0123, gbps: Optional[float] = 812.5,
         gflops: Optional[float] = 3.2, peers: Optional[Dict[str, Any]] = None,
         frac_bw: Optional[float] = 0.61) -> Dict[str, Any]:
    size = shapes[0][0] if shapes else 1
    return {
        "id": f"{family}/{op}[{variant}]/{size}/{dtype}", "family": family, "op": op,
        "api": "CudaMath", "variant": variant, "dtype": dtype, "size": size, "shapes": shapes,
        "status": status, "error": "max relative error 3 above 1e-4" if status == "failed"
        else None, "phase": "accuracy" if status == "failed" else None, "reason": None,
        "time_ms": {"median": median, "p20": median * 0.98, "p80": median * 1.07},
        "cpu_time_ms": {"median": median * 31.7}, "speedup_vs_cpu": 31.7, "gbps": gbps,
        "gflops": gflops, "fraction_of_bandwidth": frac_bw,
        "fraction_of_compute": 0.0123 if gflops else None,
        "accuracy": {"max_rel_error": 3.1e-8}, "peers": peers or {},
    }


def document(fallback: bool, with_peers: bool = True) -> Dict[str, Any]:
    peers = {"torch": {"ratio": 1.234}, "cupy": {"skipped": "no equivalent"}} \
        if with_peers else {}
    long_shapes = [[1024, 1024], [1024, 4096], [4096], [4096, 1024], [1024]]
    cases = [
        case("vector", "add", [[1 << 26], [1 << 26]], peers=peers),
        case("vector", "multiply", [[4096]], variant="scalar", peers=peers, gflops=None),
        case("vector", "fill", [[4096]], peers=peers, gflops=None, frac_bw=2.5 if fallback
             else 0.9),
        case("matrix", "matrix_multiply", [[4096, 4096], [4096, 4096]], variant="tf32",
             gflops=275123.4, peers=peers),
        case("matrix", "permute", [[8, 32, 2304]],
             variant="qkv heads (8,n/8,2304)->(3,8,12,n/8,64)", peers=peers),
        case("ml", "fused_linear_gelu_backward", long_shapes, variant="rows 32s, tanh GELU",
             dtype="bfloat16", peers=peers, status="failed"),
        case("ml", "flash_attention", [[2, 8, 1024, 64]] * 3, variant="causal",
             dtype="float16", peers=peers),
        case("transfers", "copy_to_device", [[1 << 18]], variant="pinned", peers=peers,
             gflops=None, frac_bw=None),
    ]
    avail = {"available": with_peers, "version": "2.11", "reason": "no GPU", "device": "gpu"}
    return {
        "banner": "FALLBACK MODE: no GPU was used (PyCUDA cannot be imported). 'Ours' ran on "
                  "the host through NumPy: these numbers say nothing about GPU performance."
        if fallback else None,
        "fallback_mode": fallback,
        "device": {"name": "NVIDIA H100 80GB HBM3", "compute_capability": [9, 0],
                   "multiprocessor_count": 132, "memory_total": 80 << 30,
                   "l2_cache_size": 50 << 20},
        "ceilings": {"memory_bandwidth_gbps": 3000.0,
                     "memory_bandwidth": {"method": "device-to-device copy, CUDA events; "
                                                   "counts bytes read + bytes written"},
                     "compute": {"fp32": {"gflops": 66900.0, "formula": "SMs x clock x 2 x "
                                          "128 FP32 lanes (a long formula text that wraps)"}}},
        "counts": {"total": len(cases), "passed": len(cases) - 1, "failed": 1, "skipped": 0},
        "interrupted": False, "generated_at": "2026-11-24T08:00:00+0000", "duration_s": 12.5,
        "git_commit": "0123456789abcdef0123456789abcdef01234567+dirty",
        "versions": {"cuda_backend": "0.1.0", "python": "3.11.7", "numpy": "2.4.6",
                     "nvcc": "Cuda compilation tools, release 13.0, V13.0.88",
                     "matplotlib": "3.11.2", "torch": "2.11.0+cu130", "cupy": "13.6.0"},
        "timing": {"description": "CUDA events around each call on the default stream; 5 "
                                  "warm-up + 20 timed calls per case; L2 flush: 256 MiB"},
        "peers": {"numpy": dict(avail, available=True, device="cpu"), "torch": dict(avail),
                  "cupy": dict(avail)},
        "warnings": ["a warning long enough to need wrapping in a terminal of one hundred "
                     "columns, which is the width the summary promises to stay within"],
        "coverage": {"CudaML.softmax": "same operation as CudaMath.softmax"},
        "cases": cases,
        "outputs": {"directory": "/tmp/x", "files": ["speedup.png", "results.json",
                                                     "results.schema.json", "summary.md",
                                                     "index.html", "profile_stats.json",
                                                     "trace.json"]},
    }


@pytest.mark.parametrize("fallback", [False, True], ids=["gpu", "fallback"])
@pytest.mark.parametrize("with_peers", [True, False], ids=["peers", "no-peers"])
def test_terminal_tables_fit_100_columns(fallback, with_peers):
    text = render.to_text(document(fallback, with_peers and not fallback))
    lines = text.splitlines()
    too_wide = [ln for ln in lines if len(ln) > render.TERMINAL_WIDTH]
    assert not too_wide, "\n".join(too_wide)
    for title in ("Vector operations", "Matrix operations", "ML operations (CudaML)",
                  "Copies, pool and launch", "FAILURES (1)"):
        assert f"== {title} ==" in text
    # what identifies a row survives the fitting: op, the failed row's status
    assert "fused_linear_gelu_backward" in text and "FAILED" in text


def test_terminal_fit_for_the_stored_h200_report():
    path = REPO / "reports" / "nvidia-h200" / "results.json"
    if not path.exists():
        pytest.skip("no stored report")
    text = render.to_text(json.loads(path.read_text()))
    assert max(len(ln) for ln in text.splitlines()) <= render.TERMINAL_WIDTH


def test_legend_explains_exactly_the_columns_shown():
    doc = document(fallback=False)
    text = render.to_text(doc)
    legend_text = " ".join(text.split("\n\n")[-1].split())   # unwrapped
    shown = {h for t in render.tables(doc) if t.is_cases
             for h in render.fit_table(t).headers + render.fit_table(t).folded}
    for column, meaning in render.LEGEND.items():
        assert (f"{column}: " in legend_text) is (column in shown), column
    # no case has GFLOP/s: that column is in no table, and so not in the legend
    for c in doc["cases"]:
        c["gflops"], c["fraction_of_compute"] = None, None
    md = render.to_markdown(doc, [])
    assert "| GFLOP/s |" not in md and "| of peak |" not in md
    assert "GFLOP/s: " not in md and "of peak: " not in md


def test_columns_left_out_in_the_terminal_are_named_and_kept_in_markdown():
    doc = document(fallback=False)
    fitted = [render.fit_table(t) for t in render.tables(doc) if t.is_cases]
    matrix = next(t for t in fitted if t.title == "Matrix operations")
    assert "left out to fit 100 columns" in matrix.note
    md = render.to_markdown(doc, [])
    assert "| p20-p80 ms |" in md and "| CPU ms |" in md and "| vs torch |" in md


def test_fallback_rows_show_of_bw_as_not_applicable():
    doc = document(fallback=True, with_peers=False)
    md = render.to_markdown(doc, [])
    table = next(t for t in render.tables(doc) if t.title == "Vector operations")
    col = table.headers.index("of BW")
    assert {r[col] for r in table.rows} == {"n/a"}
    assert "250%" not in md
    text = render.to_text(doc)
    assert "of BW n/a" in text         # folded under the table: every row's value


def test_gpu_rows_show_of_bw_as_a_percentage():
    table = next(t for t in render.tables(document(fallback=False))
                 if t.title == "Vector operations")
    col = table.headers.index("of BW")
    assert [r[col] for r in table.rows] == ["61%", "61%", "90%"]


def test_index_and_summary_link_the_data_files_and_the_trace():
    doc = document(fallback=False)
    page = render.to_html(doc, ["speedup.png"])
    for name in ("results.json", "summary.md", "trace.json", "profile_stats.json"):
        assert f"<a href='{name}'>" in page
    assert "ui.perfetto.dev" in page and "chrome://tracing" in page
    md = render.to_markdown(doc, ["speedup.png"])
    assert "[`trace.json`](trace.json)" in md and "ui.perfetto.dev" in md
    doc["outputs"]["files"] = ["results.json", "summary.md", "index.html"]
    assert "trace.json" not in render.to_html(doc, [])


def test_reports_readme_is_built_from_the_results(tmp_path):
    assert "No report has been written here yet." in render_readme(tmp_path)
    doc = document(fallback=True)
    doc["configuration"] = {"quick": True}
    (tmp_path / "host-cpu").mkdir()
    (tmp_path / "host-cpu" / "results.json").write_text(json.dumps(doc))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "results.json").write_text("{not json")
    text = render_readme(tmp_path)
    assert "[`host-cpu/`](host-cpu/summary.md)" in text
    assert "fallback (no GPU), quick" in text and "8: 7 passed, 1 failed, 0 skipped" in text
    assert "`0123456789ab`" in text and "3000 GB/s" in text and "broken" not in text


def test_stored_reports_readme_is_current():
    """reports/README.md is what reports_readme makes of the stored reports."""
    root = REPO / "reports"
    if not (root / "README.md").exists():
        pytest.skip("no reports folder")
    assert (root / "README.md").read_text() == render_readme(root), \
        "reports/README.md is stale: python -m cuda_backend.performance.reports_readme reports"


# -- profiling outputs ----------------------------------------------------------------------
def test_json_files_get_the_mode_open_gives_unless_private(tmp_path):
    import os
    import stat
    from cuda_backend.profiling import write_json_atomic
    umask = os.umask(0o022)
    os.umask(umask)
    write_json_atomic(str(tmp_path / "trace.json"), {"traceEvents": []})
    write_json_atomic(str(tmp_path / "autotune.json"), {"choices": {}}, private=True)
    (tmp_path / "plain.json").write_text("{}")
    mode = stat.S_IMODE((tmp_path / "trace.json").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain.json").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "autotune.json").stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["autotune.json", "plain.json",
                                                          "trace.json"]   # no temporaries


def test_profile_report_files_and_the_empty_trace_warning(tmp_path):
    import stat
    from cuda_backend import get_cuda_backend
    from cuda_backend.performance import CudaPerformanceTester, TestConfiguration
    cfg = TestConfiguration(quick=True, operations=["vector_add"], profile=True,
                            sizes={"vector": [257]}, output_dir=str(tmp_path),
                            peers=("numpy",), progress=False, enable_plots=False)
    summary = CudaPerformanceTester(cfg).run_comprehensive_benchmark()
    folder = Path(summary["outputs"]["directory"])
    modes = {n: stat.S_IMODE((folder / n).stat().st_mode)
             for n in ("results.json", "summary.md", "trace.json", "profile_stats.json")}
    assert len(set(modes.values())) == 1, modes
    empty = [w for w in summary["warnings"] if "empty trace" in w]
    events = json.loads((folder / "trace.json").read_text())["traceEvents"]
    assert bool(empty) is (not events)
    if not get_cuda_backend().is_available:
        assert empty and "fallback mode runs no kernels" in empty[0]
    assert "ui.perfetto.dev" in (folder / "index.html").read_text()
    assert (tmp_path / "README.md").exists()          # the reports folder's index


def test_nvtx_range_pushes_and_pops_or_does_nothing(monkeypatch):
    from cuda_backend import profiling
    calls = []

    class Lib:
        def nvtxRangePushA(self, name):
            calls.append(("push", name))

        def nvtxRangePop(self):
            calls.append(("pop",))
    monkeypatch.setattr(profiling, "nvtx_library", lambda: Lib())
    with pytest.raises(KeyError):
        with profiling.nvtx_range("vector/add/4096/float32"):
            raise KeyError("the range is closed on the way out")
    with profiling.nvtx_range("off", enabled=False):
        pass
    assert calls == [("push", b"vector/add/4096/float32"), ("pop",)]
    monkeypatch.setattr(profiling, "nvtx_library", lambda: None)
    with profiling.nvtx_range("no library"):
        pass
    assert len(calls) == 2
