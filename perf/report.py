"""The performance report from a checkout, without installing: the same options and the same
function as `cuda-backend report`.

    python perf/report.py [--quick] [--ops NAME...] [--out DIR] [--profile] [--no-peers]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cuda_backend.cli import add_report_options, cmd_report  # noqa: E402


def main() -> int:
    parser = add_report_options(argparse.ArgumentParser(
        prog="perf/report.py", description=cmd_report.__doc__))
    return cmd_report(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
