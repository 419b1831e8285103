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


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="cuda-backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the devices table and the fallback status")
    args = parser.parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
