"""`cuda-backend` command line: `info` prints the devices; `report` runs the benchmarks."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def cmd_info(_: argparse.Namespace) -> int:
    from .backend import get_cuda_backend
    b = get_cuda_backend()
    if not b.is_available:
        print(f"fallback mode: {b.fallback_reason}")
    print(f"{'id':>2}  {'name':<28} {'cc':>4} {'memory':>9} {'SMs':>4} {'L2':>7} "
          f"{'bandwidth':>10}  pci")
    for d in b.devices:
        print(f"{d.device_id:>2}  {d.name[:28]:<28} {'%d.%d' % d.compute_capability:>4} "
              f"{d.memory_total / 2**30:>7.1f}Gi {d.multiprocessor_count:>4} "
              f"{d.l2_cache_size / 2**20:>5.1f}Mi {d.theoretical_bandwidth_gbps:>7.0f}GB/s  "
              f"{d.pci_bus_id}")
    v = b.versions()
    print("versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
    return 0


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
                             "Chrome trace (trace.json) of every launch and copy")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip CuPy and PyTorch (the CPU NumPy baseline is still timed)")
    return parser


def cmd_report(args: argparse.Namespace) -> int:
    """Run the benchmarks, print the summary, write the report. Exit status: 0 all passed,
    1 some case failed, 2 bad options, 130 interrupted (the partial report is written)."""
    from .performance import CudaPerformanceTester, TestConfiguration
    peers = ("numpy",) if args.no_peers else ("numpy", "cupy", "torch")
    try:
        config = TestConfiguration(quick=args.quick, operations=args.ops, output_dir=args.out,
                                   profile=args.profile, peers=peers)
        tester = CudaPerformanceTester(config)
        summary = tester.run_comprehensive_benchmark()
    except ValueError as exc:
        print(f"cuda-backend report: {exc}", file=sys.stderr)
        return 2
    tester.print_summary_report(summary)
    if summary["interrupted"]:
        print("interrupted: the report holds the cases measured so far", file=sys.stderr)
        return 130
    failed = summary["counts"]["failed"]
    if failed:
        print(f"{failed} case(s) failed: see the FAILURES table", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="cuda-backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the devices table and the fallback status")
    add_report_options(sub.add_parser(
        "report", help="benchmark the backend and write results.json, charts, summary.md "
                       "and index.html"))
    args = parser.parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    if args.command == "report":
        return cmd_report(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
