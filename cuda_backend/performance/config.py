"""`TestConfiguration`: what the performance tester measures and where it writes the report.

The documented API's fields (max_error_threshold, warmup_iterations, benchmark_iterations,
enable_plots, save_results) keep their meaning; the rest select operations, sizes, peers and
the L2 flush.
`quick=True` trims sizes and iterations so a run takes seconds (under a minute without a GPU).
`preset` names a set of cases and sizes (presets.py); `sizes` (`--sizes`, `parse_sizes`)
overrides the sizes family by family.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

from .presets import preset as find_preset

FAMILIES = ("vector", "matrix", "ml", "transfers")

# Sizes per family. vector: elements of a 1-D tensor; matrix: n for n x n operands (n^3
# matmuls); ml: the spatial/sequence scale each ML case derives its shapes from (see
# cases_ml.py); transfers: bytes per copy.
DEFAULT_SIZES: Dict[str, List[int]] = {
    "vector": [1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 26],
    "matrix": [256, 1024, 2048, 4096],
    "ml": [32, 128],
    "transfers": [1 << 20, 1 << 24, 1 << 28],
}
QUICK_SIZES: Dict[str, List[int]] = {
    "vector": [1 << 12, 1 << 16, 1 << 20],
    "matrix": [64, 256],
    "ml": [16],
    "transfers": [1 << 20, 1 << 24],
}
QUICK_WARMUP = 1
QUICK_ITERATIONS = 5


@dataclass
class TestConfiguration:
    """Options of one benchmark run (the documented API's TestConfiguration, extended)."""

    __test__ = False  # not a pytest test class, despite its documented name

    max_error_threshold: float = 1e-4
    warmup_iterations: int = 5
    benchmark_iterations: int = 20
    enable_plots: bool = True
    save_results: bool = True
    output_dir: str = "reports"
    operations: Optional[Sequence[str]] = None
    sizes: Optional[Dict[str, Sequence[int]]] = None
    peers: Sequence[str] = ("numpy", "cupy", "torch")
    flush_l2: bool = True
    quick: bool = False
    profile: bool = False
    device_id: int = 0
    progress: bool = True
    cpu_time_budget_s: float = 0.5  # per case: CPU NumPy timing stops after this
    preset: Optional[str] = None    # a name of presets.PRESETS

    def __post_init__(self) -> None:
        if self.max_error_threshold <= 0:
            raise ValueError(f"max_error_threshold must be > 0, got {self.max_error_threshold}")
        if self.warmup_iterations < 0:
            raise ValueError(f"warmup_iterations must be >= 0, got {self.warmup_iterations}")
        if self.benchmark_iterations < 1:
            raise ValueError(
                f"benchmark_iterations must be >= 1, got {self.benchmark_iterations}")
        if self.sizes is not None:
            if not isinstance(self.sizes, dict):
                raise TypeError(
                    "sizes must be a dict {family: [sizes]} with families "
                    f"{', '.join(FAMILIES)}; got {type(self.sizes).__name__}")
            unknown = set(self.sizes) - set(FAMILIES)
            if unknown:
                raise ValueError(f"unknown families in sizes: {sorted(unknown)} "
                                 f"(known: {', '.join(FAMILIES)})")
        if self.preset is not None:
            find_preset(self.preset)  # ValueError naming the known presets
        if isinstance(self.operations, str):
            self.operations = [self.operations]
        self.peers = tuple(self.peers)

    # -- effective values ------------------------------------------------------------
    @property
    def warmup(self) -> int:
        return min(self.warmup_iterations, QUICK_WARMUP) if self.quick \
            else self.warmup_iterations

    @property
    def iterations(self) -> int:
        return min(self.benchmark_iterations, QUICK_ITERATIONS) if self.quick \
            else self.benchmark_iterations

    def sizes_for(self, family: str) -> List[int]:
        """The sizes a family runs at: the configured ones, else the preset's, else quick or
        full defaults."""
        if self.sizes and family in self.sizes:
            return [int(s) for s in self.sizes[family]]
        preset_sizes = find_preset(self.preset).sizes if self.preset else {}
        if family in preset_sizes:
            return list(preset_sizes[family])
        return list((QUICK_SIZES if self.quick else DEFAULT_SIZES)[family])

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["operations"] = list(self.operations) if self.operations else None
        d["peers"] = list(self.peers)
        d["effective"] = {"warmup_iterations": self.warmup,
                          "benchmark_iterations": self.iterations,
                          "sizes": {f: self.sizes_for(f) for f in FAMILIES}}
        return d


def parse_sizes(items: Sequence[str]) -> Dict[str, Sequence[int]]:
    """`--sizes` items, each FAMILY=N[,N...] (N an integer or 2^K), into
    TestConfiguration.sizes: ["matrix=1000,3000", "vector=2^20"] ->
    {"matrix": [1000, 3000], "vector": [1048576]}. ValueError says what is wrong."""
    sizes: Dict[str, Sequence[int]] = {}
    for item in items:
        family, eq, values = item.partition("=")
        if not eq or family not in FAMILIES:
            raise ValueError(f"--sizes {item!r}: write FAMILY=N[,N...] with FAMILY one of "
                             f"{', '.join(FAMILIES)} (e.g. matrix=1000,3000 ml=56)")
        sizes[family] = [_size(item, v) for v in values.split(",")]
    return sizes


def _size(item: str, text: str) -> int:
    base, caret, exponent = text.strip().partition("^")
    try:
        n = int(base) ** int(exponent) if caret else int(base)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--sizes {item!r}: {text!r} is not a positive integer (or 2^K)")
    return n
