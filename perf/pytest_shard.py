"""Run pytest on the test node ids listed in a file (one per line), plus any pytest options:
    python perf/pytest_shard.py SHARD_FILE [pytest options...]
perf/sanitize.sh deals the suite's node ids into shards and runs one sanitized process per
shard, since pytest-xdist's workers talk over the stdout that the sanitizer writes into."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        ids = [line.rstrip("\n") for line in f if line.strip()]
    sys.exit(pytest.main(sys.argv[2:] + ids))
