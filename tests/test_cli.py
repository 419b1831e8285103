"""The `cuda-backend` command (cuda_backend/cli.py): --version, `python -m cuda_backend` as the
same command as the entry point, help texts that describe each command and list the exit
statuses, the exit statuses themselves, `info` with whole device names; the packaging files
a newcomer expects (LICENSE matching the metadata, py.typed shipped)."""
from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import cuda_backend
from cuda_backend import cli

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    """python *args in a subprocess, in the mode this process is in (GPU or fallback)."""
    env = dict(os.environ,
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=str(REPO))


def test_version():
    r = run("-m", "cuda_backend", "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"cuda-backend {cuda_backend.__version__}"


def test_python_m_is_the_entry_point():
    """`python -m cuda_backend` and the console script run the same main()."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    scripts = cfg["options.entry_points"]["console_scripts"]
    assert "cuda-backend = cuda_backend.cli:main" in scripts
    module = run("-m", "cuda_backend", "--help")
    script = run("-m", "cuda_backend.cli", "--help")
    assert module.returncode == script.returncode == 0, module.stderr
    assert module.stdout == script.stdout
    assert module.stdout.startswith("usage: cuda-backend ")


@pytest.mark.parametrize("command", [[], ["info"], ["report"]], ids=["main", "info", "report"])
def test_help_describes_the_command_and_lists_exit_statuses(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(command + ["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "exit status:" in out
    for code, what in cli.EXIT_CODES:
        assert f"  {code:<4} {what.split(' (')[0]}" in out, (code, out)
    description = {"": "`info` lists the devices, `report` benchmarks",
                   "info": "Print one line per device",
                   "report": "Benchmark every operation"}[" ".join(command)]
    assert description in out


def test_info_help_runs_as_a_command():
    r = run("-m", "cuda_backend", "info", "--help")
    assert r.returncode == 0 and "usage: cuda-backend info" in r.stdout
    assert "fallback mode" in r.stdout and "versions" in r.stdout


@pytest.mark.parametrize("argv", [["bogus"], [], ["report", "--no-such-option"]],
                         ids=["unknown-command", "no-command", "unknown-option"])
def test_bad_command_line_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == cli.EXIT_USAGE == 2
    assert "usage: cuda-backend" in capsys.readouterr().err


def test_info_prints_the_whole_device_name():
    r = run("-m", "cuda_backend", "info")
    assert r.returncode == 0, r.stderr
    b = cuda_backend.get_cuda_backend()
    for d in b.devices:
        assert f" {d.name} " in r.stdout
    assert ("fallback mode:" in r.stdout) is (not b.is_available)
    assert "versions:" in r.stdout


def test_device_rows_keep_long_names():
    long_name = "NVIDIA H100 80GB HBM3 (a name much longer than any column would allow)"
    dev = SimpleNamespace(device_id=3, name=long_name, compute_capability=(9, 0),
                          memory_total=80 << 30, multiprocessor_count=132,
                          l2_cache_size=50 << 20, theoretical_bandwidth_gbps=3352.3,
                          pci_bus_id="0000:19:00.0")
    lines = cli.format_rows(cli.device_rows([dev], fallback=False))
    assert long_name in lines[1] and "9.0" in lines[1] and "3352 GB/s" in lines[1]
    assert lines[0].index("cc") == lines[1].index("9.0")   # columns line up
    host = cli.device_rows([dev], fallback=True)[1]
    assert host[2] == host[5] == host[6] == host[7] == "n/a"


class StubTester:
    """Stands in for CudaPerformanceTester: a summary with `failed` failures."""

    failed = 0
    interrupted = False

    def __init__(self, config):
        self.config = config

    def run_comprehensive_benchmark(self):
        return {"interrupted": self.interrupted, "counts": {"failed": self.failed}}

    def print_summary_report(self, summary):
        print("summary printed")


@pytest.mark.parametrize("failed, interrupted, code", [(0, False, 0), (3, False, 1),
                                                       (0, True, 130), (2, True, 130)])
def test_report_exit_statuses(monkeypatch, capsys, tmp_path, failed, interrupted, code):
    import cuda_backend.performance as perf
    monkeypatch.setattr(StubTester, "failed", failed)
    monkeypatch.setattr(StubTester, "interrupted", interrupted)
    monkeypatch.setattr(perf, "CudaPerformanceTester", StubTester)
    assert cli.main(["report", "--quick", "--out", str(tmp_path)]) == code
    assert code in dict(cli.EXIT_CODES)
    assert "summary printed" in capsys.readouterr().out


def test_license_matches_the_metadata_and_py_typed_ships():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert cfg["metadata"]["license"] == "MIT"
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in text
    assert "LICENSE" in cfg["metadata"]["license_files"]
    assert (REPO / "cuda_backend" / "py.typed").exists()
    assert "py.typed" in cfg["options.package_data"]["cuda_backend"]
