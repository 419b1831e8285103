"""`cuda-backend` command line (also `python -m cuda_backend`): `info` prints the devices,
`report` benchmarks the backend and writes the report, `compare` sets two reports side by
side."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from . import __version__
from .performance.presets import PRESETS, presets_text

# Exit statuses, listed in `--help`. `report` uses all of them, `info` 0 and 2.
EXIT_OK = 0
EXIT_CASE_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_CODES = (
    (EXIT_OK, "success (in fallback mode too: no GPU is not an error)"),
    (EXIT_CASE_FAILED, "report: at least one case failed (see its FAILURES table); "
                       "compare: one got WORSE"),
    (EXIT_USAGE, "bad command line or options (the message says which)"),
    (EXIT_INTERRUPTED, "report: interrupted by Ctrl-C or SIGTERM (the cases measured so far "
                       "are written)"),
)


def exit_codes_text() -> str:
    """The exit-status table of `--help`."""
    return "exit status:\n" + "\n".join(f"  {code:<4} {what}" for code, what in EXIT_CODES)


def _cell(value: object, missing: bool) -> str:
    return "n/a" if missing else str(value)


def device_rows(devices: Sequence, fallback: bool) -> List[List[str]]:
    """One row per device for `info`: the whole name, and n/a where fallback mode has no
    value (no compute capability, L2, bandwidth or PCI bus for the host)."""
    rows = [["id", "name", "cc", "memory", "SMs" if not fallback else "cores", "L2",
             "bandwidth", "PCI bus"]]
    for d in devices:
        rows.append([
            str(d.device_id), d.name,
            _cell("%d.%d" % tuple(d.compute_capability), fallback),
            f"{d.memory_total / 2**30:.1f} GiB",
            str(d.multiprocessor_count),
            _cell(f"{d.l2_cache_size / 2**20:.1f} MiB", fallback or not d.l2_cache_size),
            _cell(f"{d.theoretical_bandwidth_gbps:.0f} GB/s",
                  fallback or not d.theoretical_bandwidth_gbps),
            _cell(d.pci_bus_id, fallback or not d.pci_bus_id),
        ])
    return rows


def format_rows(rows: List[List[str]]) -> List[str]:
    """Columns padded to their widest cell (nothing is cut)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def cmd_info(_: argparse.Namespace) -> int:
    """Print every device (the host in fallback mode) and the versions in use."""
    from .backend import get_cuda_backend
    b = get_cuda_backend()
    if not b.is_available:
        print(f"fallback mode: {b.fallback_reason}")
    for line in format_rows(device_rows(b.devices, not b.is_available)):
        print(line)
    v = b.versions()
    print("versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
    return EXIT_OK


def add_report_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `report` options (shared with perf/report.py)."""
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few iterations (seconds; under a minute "
                             "without a GPU)")
    parser.add_argument("--ops", nargs="+", metavar="NAME",
                        help="only these operations or families (e.g. add matrix_multiply "
                             "transfers)")
    parser.add_argument("--out", default="reports", metavar="DIR",
                        help="output folder; the report goes to DIR/<device-slug>/ "
                             "(default: reports)")
    parser.add_argument("--profile", action="store_true",
                        help="also write the backend's stats (profile_stats.json) and a "
                             "Chrome trace (trace.json, open it in https://ui.perfetto.dev or "
                             "chrome://tracing) of every launch and copy; each case is an "
                             "NVTX range for Nsight Systems where libnvtx is found")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip CuPy and PyTorch (the CPU NumPy baseline is still timed)")
    parser.add_argument("--preset", metavar="NAME", choices=list(PRESETS),
                        help="a named set of cases and sizes: " + ", ".join(PRESETS)
                             + " (`cuda-backend report --help` describes each); --ops "
                               "narrows it, --sizes resizes it")
    parser.add_argument("--sizes", nargs="+", metavar="FAMILY=N[,N...]",
                        help="the sizes of a family, in place of the defaults (and the "
                             "preset's): vector elements, matrix n (n x n operands), ml the "
                             "scale s (images s x s), transfers bytes; N an integer or 2^K "
                             "(e.g. --sizes matrix=1000,3000 ml=56,224)")
    parser.add_argument("--compare", metavar="OLD",
                        help="after the run, compare with an earlier report (its results.json "
                             "or folder): the table is printed and added to summary.md")
    parser.add_argument("--list", action="store_true",
                        help="print the ids of the cases these options select, and exit "
                             "(nothing runs)")
    return parser


def cmd_report(args: argparse.Namespace) -> int:
    """Run the benchmarks, print the summary, write the report (exit statuses: EXIT_CODES)."""
    from .performance import CudaPerformanceTester, TestConfiguration
    from .performance.compare import load_results
    from .performance.config import parse_sizes
    peers = ("numpy",) if args.no_peers else ("numpy", "cupy", "torch")
    try:
        old = load_results(args.compare) if args.compare else None  # bad OLD: before the run
        config = TestConfiguration(quick=args.quick, operations=args.ops, output_dir=args.out,
                                   profile=args.profile, peers=peers, preset=args.preset,
                                   sizes=parse_sizes(args.sizes) if args.sizes else None)
        tester = CudaPerformanceTester(config)
        if args.list:
            for case in tester.planned_cases():
                print(case.id)
            return EXIT_OK
        summary = tester.run_comprehensive_benchmark()
    except ValueError as exc:
        print(f"cuda-backend report: {exc}", file=sys.stderr)
        return EXIT_USAGE
    tester.print_summary_report(summary)
    if old is not None:
        print_comparison(old, args.compare, summary)
    if summary["interrupted"]:
        print("interrupted: the report holds the cases measured so far", file=sys.stderr)
        return EXIT_INTERRUPTED
    failed = summary["counts"]["failed"]
    if failed:
        print(f"{failed} case(s) failed: see the FAILURES table", file=sys.stderr)
        return EXIT_CASE_FAILED
    return EXIT_OK


def print_comparison(old: dict, old_path: str, summary: dict) -> None:
    """`report --compare OLD`: the comparison with this run, printed and added to
    summary.md."""
    from .performance import compare
    result = compare.compare(old, summary)
    labels = (compare.describe(old, f"old ({old_path})"), compare.describe(summary, "new"))
    print()
    print(compare.to_text(result, *labels))
    outputs = summary.get("outputs") or {}
    if "summary.md" in outputs.get("files", []):
        compare.append_to_summary(outputs["directory"], compare.to_markdown(result, *labels))


def cmd_compare(args: argparse.Namespace) -> int:
    """Print the comparison of two reports; 1 when a case got WORSE beyond the noise."""
    from .performance import compare
    try:
        old, new = compare.load_results(args.old), compare.load_results(args.new)
    except compare.ResultsFileError as exc:
        print(f"cuda-backend compare: {exc}", file=sys.stderr)
        return EXIT_USAGE
    result = compare.compare(old, new)
    print(compare.to_text(result, compare.describe(old, f"old ({args.old})"),
                          compare.describe(new, f"new ({args.new})")))
    return EXIT_CASE_FAILED if result.worse else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The `cuda-backend` parser: `--version`, `info`, `report`, `compare`, exit statuses
    and the report's presets in --help."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="cuda-backend", formatter_class=fmt, epilog=exit_codes_text(),
        description="A small GPU backend on PyCUDA: `info` lists the devices, `report` "
                    "benchmarks every operation\nagainst NumPy, CuPy and PyTorch. Without "
                    "PyCUDA or a GPU both run in fallback mode (NumPy on\nthe host) and say "
                    "so; `compare OLD NEW` sets two reports side by side. `python -m "
                    "cuda_backend`\nis the same command.")
    parser.add_argument("--version", action="version", version=f"cuda-backend {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{info,report,compare}")
    sub.add_parser(
        "info", formatter_class=fmt, epilog=exit_codes_text(),
        help="print the devices table and the fallback status",
        description="Print one line per device (in fallback mode the host: name, memory, CPU "
                    "cores), whether\nthe backend is in fallback mode and why, and the "
                    "versions of Python, NumPy, PyCUDA,\nthe CUDA driver and nvcc.")
    add_report_options(sub.add_parser(
        "report", formatter_class=fmt, epilog=presets_text() + "\n\n" + exit_codes_text(),
        help="benchmark the backend and write results.json, charts, summary.md and index.html",
        description="Benchmark every operation on device 0 against NumPy on the CPU and "
                    "against CuPy and PyTorch\non the GPU, print the summary tables and "
                    "write the report to DIR/<device-slug>/:\nresults.json, the charts, "
                    "summary.md and index.html."))
    compare = sub.add_parser(
        "compare", formatter_class=fmt, epilog=exit_codes_text(),
        help="compare two reports' results.json case by case (no run)",
        description="Compare two reports (results.json files, or the folders holding them): "
                    "for every case passed\nin both, ours' median and PyTorch's ratio to it "
                    "in each, the quotient new/old (> 1: better)\nand the noise (the timings' "
                    "p20-p80 spreads, added); a case is flagged WORSE when\nnew/old < 1 / "
                    "(1 + noise). `report --compare OLD` prints the same table after its run.")
    compare.add_argument("old", metavar="OLD", help="the earlier results.json (or its folder)")
    compare.add_argument("new", metavar="NEW", help="the later results.json (or its folder)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    if args.command == "report":
        return cmd_report(args)
    if args.command == "compare":
        return cmd_compare(args)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
