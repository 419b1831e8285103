"""The performance tester and report (`cuda-backend report`): CPU tests in fallback mode, and
one `gpu` test running `--quick` on a GPU.

In-process runs use tiny sizes so the whole file stays well under a minute; the command-line
runs are real `--quick` runs in a subprocess with CUDA_BACKEND_FALLBACK=1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import cuda_backend.test_cuda_performance as tcp
from cuda_backend.driver import load_driver
from cuda_backend.performance import cases_math, cases_ml, cases_training, charts, render, schema
from cuda_backend.performance import cases_ml_forward
from cuda_backend.performance.ceilings import compute_peaks
from cuda_backend.performance.config import TestConfiguration as Config
from cuda_backend.performance.progress import Progress
from cuda_backend.performance.runner import context_dead
from cuda_backend.performance.timing import stats

REPO = Path(__file__).resolve().parents[1]
# In-process runs are fallback-mode tests; on a GPU an op that faults would poison the
# process's context for every later test, so there the subprocess GPU test covers the tester.
fallback_only = pytest.mark.skipif(load_driver()[0] is not None,
                                   reason="in-process fallback test; the GPU run is "
                                          "test_gpu_quick_report")
TINY = {"vector": [257], "matrix": [33], "ml": [8], "transfers": [1 << 16]}

# The documented API's "Running Benchmarks" example (../shared/seeds/001_097e3d6e2f3c2394.txt),
# verbatim except for the import root.
SEED_SNIPPET = textwrap.dedent('''
    from cuda_backend.test_cuda_performance import CudaPerformanceTester, TestConfiguration

    # Configure benchmark
    config = TestConfiguration(
        max_error_threshold=1e-4,
        warmup_iterations=5,
        benchmark_iterations=20,
        enable_plots=True,
        save_results=True
    )

    # Run comprehensive benchmark
    tester = CudaPerformanceTester(config)
    summary = tester.run_comprehensive_benchmark()

    # Print results
    tester.print_summary_report(summary)
''')


def run_cli(args, tmp_path, fallback=True, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if fallback:
        env["CUDA_BACKEND_FALLBACK"] = "1"
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=timeout)


def report_dir(out: Path) -> Path:
    dirs = [d for d in out.iterdir() if d.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def tiny_tester(tmp_path, **kw):
    cfg = dict(quick=True, sizes=TINY, output_dir=str(tmp_path), progress=False)
    cfg.update(kw)
    return tcp.CudaPerformanceTester(tcp.TestConfiguration(**cfg))


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """One in-process run of every case family at tiny sizes, shared by several tests."""
    out = tmp_path_factory.mktemp("report")
    summary = tiny_tester(out).run_comprehensive_benchmark()
    return summary, report_dir(out)


# -- the written report ---------------------------------------------------------------
@fallback_only
def test_results_json_matches_schema(quick_report):
    summary, folder = quick_report
    doc = json.loads((folder / "results.json").read_text())
    assert schema.validate(doc) == []
    assert doc["schema_version"] == schema.SCHEMA_VERSION
    assert doc["counts"]["total"] == len(doc["cases"]) > 40
    assert doc["counts"]["passed"] + doc["counts"]["failed"] + doc["counts"]["skipped"] \
        == doc["counts"]["total"]
    for key in ("cuda_backend", "numpy", "pycuda", "cuda_driver", "nvcc", "matplotlib"):
        assert key in doc["versions"]
    assert doc["device"]["slug"] == folder.name
    assert json.loads((folder / "results.schema.json").read_text()) == schema.SCHEMA
    # a measured case records its time distribution, CPU time and speed-up, bandwidth, shapes,
    # dtype, accuracy against its threshold and the peers
    passed = [c for c in doc["cases"] if c["status"] == "passed" and c["family"] == "vector"]
    assert passed
    c = passed[0]
    assert set(c["time_ms"]) == {"median", "mean", "min", "max", "p20", "p80", "count"}
    assert c["time_ms"]["min"] <= c["time_ms"]["p20"] <= c["time_ms"]["median"] \
        <= c["time_ms"]["p80"] <= c["time_ms"]["max"]
    assert c["cpu_time_ms"]["median"] > 0 and c["speedup_vs_cpu"] > 0
    assert c["gbps"] > 0 and c["bytes"] > 0 and c["shapes"] and c["dtype"] == "float32"
    assert c["accuracy"]["passed"] and c["accuracy"]["threshold"] > 0
    assert c["accuracy"]["max_rel_error"] <= c["accuracy"]["threshold"]
    assert set(c["peers"]) == {"cupy", "torch"}


def test_validator_reports_problems():
    doc = {"schema_version": schema.SCHEMA_VERSION, "cases": [{"id": 3}]}
    errors = schema.validate(doc)
    assert any("missing required field 'device'" in e for e in errors)
    assert any("$.cases[0].id: expected string" in e for e in errors)
    assert any("$.cases[0]: missing required field 'status'" in e for e in errors)
    with pytest.raises(ValueError, match="do not match the schema"):
        schema.check(doc)


@fallback_only
def test_every_chart_is_written_and_opens(quick_report):
    from matplotlib import image
    summary, folder = quick_report
    assert summary["outputs"]["charts"] == list(charts.CHARTS)
    for name in charts.CHARTS:
        img = image.imread(str(folder / name))
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200, name
        assert float(img.std()) > 0.01, f"{name} is blank"


@fallback_only
def test_markdown_and_html_show_the_same_tables(quick_report):
    summary, folder = quick_report
    md = (folder / "summary.md").read_text()
    page = (folder / "index.html").read_text()
    for table in render.tables(summary):
        assert f"## {table.title}" in md
        assert f"<h2>{table.title}</h2>" in page
    for name in charts.CHARTS:
        assert f"]({name})" in md and f"src='{name}'" in page
    if summary["fallback_mode"]:
        assert md.splitlines()[2].startswith("> **FALLBACK MODE")
        assert "class='banner'>FALLBACK MODE" in page
        assert summary["banner"].startswith("FALLBACK MODE")


@fallback_only
def test_every_cudamath_operation_has_a_case(quick_report):
    summary, _ = quick_report
    cov = summary["coverage"]
    math_ops = {k: v for k, v in cov.items() if k.startswith("CudaMath.")}
    assert len(math_ops) >= 25
    gaps = {k: v for k, v in math_ops.items() if isinstance(v, str)}
    assert gaps == {}, gaps
    ids = {c["id"] for c in summary["cases"]}
    for k, v in math_ops.items():
        assert set(v) <= ids
    assert "backend.launch_kernel" in cov and "backend.copy_to_device" in cov


@fallback_only
def test_transfers_pool_and_launch_cases(quick_report):
    summary, _ = quick_report
    by = {(c["op"], c["variant"]): c for c in summary["cases"] if c["family"] == "transfers"}
    for op in ("copy_to_device", "copy_from_device"):
        for v in ("pageable", "pinned"):
            c = by[(op, v)]
            assert c["status"] == "passed" and c["gbps"] > 0
            assert c["accuracy"]["max_abs_error"] == 0.0
    assert by[("allocate_memory", "1 MiB + free_memory")]["time_ms"]["median"] > 0
    launch = by[("launch_kernel", "empty kernel")]
    if summary["fallback_mode"]:
        assert launch["status"] == "skipped" and "GPU" in launch["reason"]
    else:
        assert launch["status"] == "passed"


# -- training steps (cases_training.py) --------------------------------------------------
# Bounds: each float32 loss is within S u (relative) of the exact one, u = 2^-24 and S the
# forward's summation lengths added up layer by layer (Model.sum_length: n u bounds a sum of
# n terms; the layers are normalised, so no layer amplifies what it receives), two of them
# within 2 S u; each step's update adds another such difference to the weights, so step k's
# losses are within 2 k S u of each other.
@fallback_only
def test_training_rows_run_and_pass_in_fallback_mode(tmp_path):
    from cuda_backend.cuda_math import get_cuda_math
    pool = get_cuda_math().backend.memory_pools[0]
    active = pool.get_stats()["active_memory"]
    summary = tiny_tester(tmp_path, operations=["training"]).run_comprehensive_benchmark()
    rows = {c["op"]: c for c in summary["cases"]}
    assert set(rows) == {"train_mlp", "train_cnn", "train_gpt"}
    for op, c in rows.items():
        assert c["family"] == "training" and c["api"] == "nn" and c["status"] == "passed", c
        acc = c["accuracy"]
        assert acc["passed"] and acc["message"] is None
        assert acc["reference"] == cases_training.REFERENCE
        assert acc["max_rel_error"] <= acc["threshold"] == 1e-4
        assert c["time_ms"]["median"] > 0 and c["flops"] > 0 and c["gflops"] > 0
        assert c["size"] == c["shapes"][0][0]                    # the batch
        assert "fallback mode" in c["peers"]["torch"]["skipped"]
        assert summary["coverage"][f"nn.{op}"] == [c["id"]]
    assert rows["train_gpt"]["variant"] == "2x32 seq32"           # the examples' small sizes
    assert schema.validate(json.loads((report_dir(tmp_path) / "results.json").read_text())) \
        == []
    assert "## Training steps (nn, autograd, optim)" in \
        (report_dir(tmp_path) / "summary.md").read_text()
    assert pool.get_stats()["active_memory"] == active          # the rows freed everything


@fallback_only
def test_training_check_catches_a_wrong_gradient_and_a_wrong_update(monkeypatch):
    from cuda_backend.autograd import apis
    ml = apis()[1]
    spec = cases_training.mlp(False)
    real_backward, real_sgd = ml.linear_backward, ml.sgd_update

    def skewed_backward(*a, **k):     # the second layer's bias gradient 1 % too large
        dx, dw, db = real_backward(*a, **k)
        return dx, dw, ml.math.multiply(db, 1.01)
    monkeypatch.setattr(ml, "linear_backward", skewed_backward)
    row = cases_training.TrainingStep(spec)
    row.step()
    _, rel, msg = row.verify()
    row.free()
    assert msg is None and rel > 1e-4                       # caught by the gradient check
    monkeypatch.setattr(ml, "linear_backward", real_backward)

    def fast_sgd(p, g, buf, state):    # a learning rate 0.1 % too large
        state.learning_rate *= 1.001
        real_sgd(p, g, buf, state)
    monkeypatch.setattr(ml, "sgd_update", fast_sgd)
    row = cases_training.TrainingStep(spec)
    row.step()
    _, rel, msg = row.verify()
    row.free()
    assert rel <= 1e-4 and "sgd step is off" in msg
    row = cases_training.TrainingStep(spec)                # verify() checks the first step only
    row.step()
    row.step()
    assert "first step" in row.verify()[2]
    row.free()


@fallback_only
@pytest.mark.parametrize("make", cases_training.MODELS, ids=lambda f: f.__name__)
def test_training_rows_match_pytorch_loss(make):
    torch = pytest.importorskip("torch")
    spec = make(False)
    curves = cases_training.loss_curves(spec, torch, "cpu", steps=3)
    for k, (ours, theirs) in enumerate(curves, 1):
        bound = 2 * k * spec.sum_length * cases_training.U32 * abs(theirs)
        assert abs(ours - theirs) <= bound, (k, ours, theirs, bound)
    assert curves[-1][0] < curves[0][0]                      # the steps train


# -- failures are reported, never hidden ---------------------------------------------
@fallback_only
def test_wrong_result_and_raising_op_are_failures(tmp_path, monkeypatch, capsys):
    from cuda_backend.cuda_math import get_cuda_math
    m = get_cuda_math()
    real_relu = m.relu

    def wrong_relu(x):  # off by 1e-2 everywhere: far above the 1e-4 threshold
        out = real_relu(x)
        return m.add(out, 1e-2)

    def broken_exp(x):
        raise RuntimeError("exp kernel exploded")
    monkeypatch.setattr(m, "relu", wrong_relu)
    monkeypatch.setattr(m, "exp", broken_exp)
    tester = tiny_tester(tmp_path, operations=["relu", "exp", "add"])
    summary = tester.run_comprehensive_benchmark()
    by = {c["op"]: c for c in summary["cases"] if c["family"] == "vector"}
    assert by["add"]["status"] == "passed"
    relu = by["relu"]
    assert relu["status"] == "failed" and relu["phase"] == "accuracy"
    assert not relu["accuracy"]["passed"]
    assert relu["accuracy"]["max_abs_error"] == pytest.approx(1e-2, rel=1e-3)
    assert "above the threshold" in relu["error"]
    exp = by["exp"]
    assert exp["status"] == "failed" and exp["phase"] == "run"
    assert exp["error"] == "RuntimeError: exp kernel exploded"
    assert summary["counts"]["failed"] == 2
    md = (report_dir(tmp_path) / "summary.md").read_text()
    assert "## FAILURES (2)" in md and "exp kernel exploded" in md and relu["id"] in md
    tester.print_summary_report(summary)
    text = capsys.readouterr().out
    assert "== FAILURES (2) ==" in text and "FAILED" in text


@fallback_only
def test_ctrl_c_keeps_the_cases_measured_so_far(tmp_path, monkeypatch):
    from cuda_backend.cuda_math import get_cuda_math
    m = get_cuda_math()
    calls = {"n": 0}
    real_sub = m.subtract

    def interrupted_subtract(a, b):
        calls["n"] += 1
        if calls["n"] > 3:  # after the first case's accuracy run and some timed calls
            raise KeyboardInterrupt
        return real_sub(a, b)
    monkeypatch.setattr(m, "subtract", interrupted_subtract)
    pool = m.backend.memory_pools[0]
    active = pool.get_stats()["active_memory"]
    sizes = dict(TINY, vector=[64, 128])
    tester = tiny_tester(tmp_path, sizes=sizes, operations=["add", "subtract", "multiply"])
    summary = tester.run_comprehensive_benchmark()
    assert summary["interrupted"] is True
    ops = [c["op"] for c in summary["cases"] if c["family"] == "vector"]
    assert ops == ["add", "add"]  # the subtract case was cut short; nothing after it ran
    doc = json.loads((report_dir(tmp_path) / "results.json").read_text())
    assert doc["interrupted"] is True and len(doc["cases"]) == len(summary["cases"])
    assert schema.validate(doc) == []
    assert "(INTERRUPTED)" in (report_dir(tmp_path) / "summary.md").read_text()
    assert pool.get_stats()["active_memory"] == active  # the cut-short case freed its tensors


@fallback_only
def test_cli_exit_status_130_on_ctrl_c(tmp_path, monkeypatch, capsys):
    from cuda_backend import cli
    from cuda_backend.cuda_math import get_cuda_math

    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(get_cuda_math(), "negative", interrupt)
    rc = cli.main(["report", "--quick", "--no-peers", "--ops", "abs", "negative",
                   "--out", str(tmp_path)])
    assert rc == 130
    doc = json.loads((report_dir(tmp_path) / "results.json").read_text())
    assert doc["interrupted"] and [c["op"] for c in doc["cases"]] == ["abs"] * 3
    assert "interrupted" in capsys.readouterr().err


@fallback_only
def test_unknown_operation_is_rejected(tmp_path, capsys):
    from cuda_backend import cli
    assert cli.main(["report", "--ops", "no_such_op", "--out", str(tmp_path)]) == 2
    assert "unknown operation(s) no_such_op" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@fallback_only
def test_faulted_context_stops_the_run_with_a_reason(tmp_path, monkeypatch):
    from cuda_backend.cuda_math import get_cuda_math
    m = get_cuda_math()

    def faulting_sqrt(x):
        raise RuntimeError("cuMemcpyDtoH failed: an illegal memory access was encountered")
    monkeypatch.setattr(m, "sqrt", faulting_sqrt)
    summary = tiny_tester(tmp_path, operations=["sqrt", "tanh"]).run_comprehensive_benchmark()
    by = {c["op"]: c for c in summary["cases"]}
    assert by["sqrt"]["status"] == "failed"
    assert by["tanh"]["status"] == "skipped" and "faulted" in by["tanh"]["reason"]
    assert any("faulted" in w for w in summary["warnings"])
    assert "## WARNINGS" in (report_dir(tmp_path) / "summary.md").read_text()
    assert context_dead("KernelLaunchError: ... unspecified launch failure")
    assert not context_dead("ShapeMismatchError: shapes (2,) and (3,)") and not context_dead(None)


# -- the documented example and the command line ----------------------------------------
@fallback_only
def test_seed_running_benchmarks_snippet(tmp_path, monkeypatch, capsys):
    """The documented snippet runs as written; the configuration it builds gets tiny sizes."""
    real = tcp.TestConfiguration

    def small(**kw):
        assert kw == dict(max_error_threshold=1e-4, warmup_iterations=5,
                          benchmark_iterations=20, enable_plots=True, save_results=True)
        return real(**kw, quick=True, sizes=TINY, progress=False,
                    operations=["vector_add", "matrix_multiply", "relu", "transfers"])
    monkeypatch.setattr(tcp, "TestConfiguration", small)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(SEED_SNIPPET, "seed-snippet", "exec"), namespace)
    summary = namespace["summary"]
    assert summary["counts"]["passed"] > 0 and summary["counts"]["failed"] == 0
    folder = report_dir(tmp_path / "reports")
    assert (folder / "results.json").exists() and (folder / "speedup.png").exists()
    assert "== Vector operations ==" in capsys.readouterr().out


@pytest.mark.exclusive   # its 60 s budget is for the machine alone, not beside a loaded suite
def test_cli_quick_fallback_end_to_end(tmp_path):
    r = run_cli(["-m", "cuda_backend.cli", "report", "--quick", "--out", "out"], tmp_path)
    folder = report_dir(tmp_path / "out")
    doc = json.loads((folder / "results.json").read_text())
    assert schema.validate(doc) == []
    assert doc["fallback_mode"] is True and doc["duration_s"] < 60
    assert r.returncode == (1 if doc["counts"]["failed"] else 0), r.stderr[-2000:]
    assert r.stdout.startswith("!!!") and "FALLBACK MODE" in r.stdout.splitlines()[1]
    assert {c["family"] for c in doc["cases"]} >= {"vector", "matrix", "transfers"}
    for name in charts.CHARTS + ("summary.md", "index.html"):
        assert (folder / name).stat().st_size > 0


def test_sigterm_writes_the_partial_report(tmp_path):
    """`timeout` sends SIGTERM: the run stops like Ctrl-C and keeps what it measured."""
    import signal
    env = dict(os.environ, CUDA_BACKEND_FALLBACK="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "cuda_backend.cli", "report", "--ops",
                             "vector", "--out", "o3"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in proc.stderr:  # the built-in progress bar's first line: cases are running
            if line.startswith("report: "):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    doc = json.loads((report_dir(tmp_path / "o3") / "results.json").read_text())
    assert doc["interrupted"] is True and doc["counts"]["total"] < 100
    assert schema.validate(doc) == []


def test_perf_report_script_same_options(tmp_path):
    r = run_cli([str(REPO / "perf" / "report.py"), "--quick", "--no-peers", "--ops",
                 "vector_add", "matrix_transpose", "--out", "o2"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((report_dir(tmp_path / "o2") / "results.json").read_text())
    assert {c["op"] for c in doc["cases"]} == {"vector_add", "matrix_transpose"}
    assert list(doc["peers"]) == ["numpy"]
    assert doc["configuration"]["quick"] is True
    help_text = run_cli([str(REPO / "perf" / "report.py"), "--help"], tmp_path).stdout
    for opt in ("--quick", "--ops", "--out", "--profile", "--no-peers", "--preset", "--sizes",
                "--compare", "--list"):
        assert opt in help_text


@fallback_only
def test_profile_writes_stats_and_trace(tmp_path):
    tester = tiny_tester(tmp_path, operations=["vector_add"], profile=True)
    summary = tester.run_comprehensive_benchmark()
    folder = report_dir(tmp_path)
    trace = json.loads((folder / "trace.json").read_text())
    assert "traceEvents" in trace
    stats_doc = json.loads((folder / "profile_stats.json").read_text())
    assert "kernel_execution_times" in stats_doc and "memory_pools" in stats_doc
    assert "profile_stats.json" in summary["outputs"]["files"]


# -- pieces ----------------------------------------------------------------------------
def test_compute_peaks_formula():
    class H100:
        compute_capability = (9, 0)
        multiprocessor_count = 132
        clock_rate_khz = 1_980_000
    peaks = compute_peaks(H100)
    assert peaks["fp32"]["gflops"] == pytest.approx(132 * 1.98e9 * 2 * 128 / 1e9)  # 66.9 TF
    assert peaks["fp64"]["gflops"] == pytest.approx(peaks["fp32"]["gflops"] / 2)
    assert peaks["bf16_tensor"]["gflops"] == pytest.approx(132 * 1.98e9 * 4096 / 1e9)
    assert "132 SMs" in peaks["fp32"]["formula"]

    class Unknown(H100):
        compute_capability = (99, 0)
    assert compute_peaks(Unknown)["fp32"]["gflops"] is None


def test_stats_and_config():
    s = stats([5.0, 1.0, 2.0, 3.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["count"]) == (3.0, 1.0, 5.0, 5)
    assert s["p20"] == pytest.approx(1.8) and s["p80"] == pytest.approx(4.2)
    assert stats([]) is None
    q = Config(quick=True)
    assert q.iterations <= 5 and q.sizes_for("vector")[-1] <= 1 << 20
    assert Config().sizes_for("vector")[-1] >= 1 << 26
    with pytest.raises(ValueError, match="unknown families"):
        Config(sizes={"vectors": [1]})
    with pytest.raises(ValueError):
        Config(benchmark_iterations=0)


def test_ml_references_match_direct_loops():
    rng = np.random.default_rng(9698)
    x, w = rng.standard_normal((2, 3, 5, 6)), rng.standard_normal((4, 3, 3, 3))
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    direct, magnitude = np.zeros((2, 4, 5, 6)), np.zeros((2, 4, 5, 6))
    for n in range(2):
        for k in range(4):
            for i in range(5):
                for j in range(6):
                    terms = xp[n, :, i:i + 3, j:j + 3] * w[k]
                    direct[n, k, i, j], magnitude[n, k, i, j] = terms.sum(), np.abs(terms).sum()
    # two float64 sums of the same 27 products in different orders differ by at most
    # 2 * 27 * eps * sum|terms| (cancellation makes a relative bound meaningless)
    bound = 2 * 27 * np.finfo(np.float64).eps * magnitude
    assert np.all(np.abs(cases_ml_forward.conv2d_nchw(np, x, w) - direct) <= bound)
    y = rng.standard_normal((1, 2, 4, 6))
    assert cases_ml_forward.pool2x2(y, "max")[0, 1, 1, 2] == y[0, 1, 2:4, 4:6].max()
    q, k, v = (rng.standard_normal((1, 1, 5, 4)) for _ in range(3))
    out = cases_ml_forward.attention(np, q, k, v, causal=True)
    s0 = q[0, 0, 2] @ k[0, 0, :3].T / 2.0
    p = np.exp(s0 - s0.max())
    np.testing.assert_allclose(out[0, 0, 2], (p / p.sum()) @ v[0, 0, :3], rtol=1e-12)
    p, g = rng.standard_normal(8), rng.standard_normal(8)
    p0 = p.copy()
    cases_ml_forward.adam(np, p, g, np.zeros(8), np.zeros(8))
    # first bias-corrected step from zero moments: p moves by lr * g / (|g| + eps)
    np.testing.assert_allclose(p, p0 - 1e-3 * g / (np.abs(g) + 1e-8), rtol=1e-9)
    buf = np.ones(8)
    cases_ml_forward.sgd(np, p0, g, buf)
    np.testing.assert_allclose(buf, 0.9 + g, rtol=1e-12)


def test_case_tables_are_well_formed():
    for table in (cases_math.MATH_OPS, cases_ml.ML_OPS):
        ids = [(d.family, d.op, d.variant) for d in table]
        assert len(ids) == len(set(ids)), "duplicate op/variant"
        for d in table:
            assert d.family in ("vector", "matrix", "ml")
            assert d.cpu is not None or d.reference is not None
    ml_ops = {d.op for d in cases_ml.ML_OPS}
    assert {"conv2d", "activation", "max_pool2d", "avg_pool2d", "batch_norm", "layer_norm",
            "dropout", "adam_update", "sgd_update", "flash_attention",
            "fused_linear_gelu"} <= ml_ops


def test_builtin_progress_bar_in_a_log(monkeypatch):
    import io
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the built-in bar, even if tqdm exists
    buf = io.StringIO()
    bar = Progress(20, stream=buf)
    for i in range(20):
        bar.step(f"case {i}")
    bar.close()
    lines = buf.getvalue().splitlines()
    assert lines[0] == "report: 0/20 cases, now case 0" and len(lines) == 10


# -- GPU -------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_quick_report(tmp_path):
    """`cuda-backend report --quick` on the GPU: CUDA events, L2 flush, measured ceilings,
    peers where installed; failures (if any) are printed for the log."""
    r = run_cli(["-m", "cuda_backend.cli", "report", "--quick", "--profile", "--out", "out"],
                tmp_path, fallback=False, timeout=900)
    folder = report_dir(tmp_path / "out")
    doc = json.loads((folder / "results.json").read_text())
    failed = [f"{c['id']}: {c['error']}" for c in doc["cases"] if c["status"] == "failed"]
    print("\n".join(failed))
    assert schema.validate(doc) == []
    assert r.returncode == (1 if failed else 0), r.stderr[-3000:]
    assert doc["fallback_mode"] is False and doc["banner"] is None
    assert doc["device"]["compute_capability"][0] >= 7
    assert doc["ceilings"]["memory_bandwidth_gbps"] > 200
    assert doc["ceilings"]["compute"]["fp32"]["gflops"] > 1000
    passed = [c for c in doc["cases"] if c["status"] == "passed"]
    assert passed
    kernels = [c for c in passed if c["family"] in ("vector", "matrix", "ml")]
    assert kernels and all(c["timer"] == "cuda_events" and c["l2_flushed"] for c in kernels)
    by = {(c["op"], c["variant"], c["size"]): c for c in doc["cases"]}
    assert by[("launch_kernel", "empty kernel", 1)]["status"] == "passed"
    assert by[("copy_to_device", "pinned", 1 << 24)]["gbps"] > 5
    trace = json.loads((folder / "trace.json").read_text())
    assert any(e["cat"] == "kernel" for e in trace["traceEvents"])
    for name in charts.CHARTS:
        assert (folder / name).stat().st_size > 0
    training = [c for c in doc["cases"] if c["family"] == "training"]
    assert {c["op"] for c in training} == {"train_mlp", "train_cnn", "train_gpt"}
    assert all(c["status"] == "passed" and c["timer"] == "cuda_events" for c in training)


@pytest.mark.gpu
def test_gpu_training_rows_match_pytorch_loss(tmp_path):
    """The GPU-sized training rows (subprocess: a fault cannot poison this process) against
    PyTorch on the same GPU, TF32 off, 3 steps; bounds as in the fallback test above."""
    pytest.importorskip("torch")
    code = ("import json, torch; from cuda_backend.performance import cases_training as ct; "
            "print(json.dumps({m(True).op: [m(True).sum_length, ct.loss_curves(m(True), "
            "torch, 'cuda', 3)] for m in ct.MODELS}))")
    r = run_cli(["-c", code], tmp_path, fallback=False, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(result) == {"train_mlp", "train_cnn", "train_gpt"}
    for op, (sum_length, curves) in result.items():
        for k, (ours, theirs) in enumerate(curves, 1):
            bound = 2 * k * sum_length * cases_training.U32 * abs(theirs)
            assert abs(ours - theirs) <= bound, (op, k, ours, theirs, bound)
