"""`python -m cuda_backend`: the `cuda-backend` command (cuda_backend/cli.py)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
