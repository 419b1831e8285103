"""Named sets of report cases: `cuda-backend report --preset NAME` (listed in its --help).

A preset picks cases from the report's tables (cases_math.py, cases_ml.py, cases_system.py,
cases_training.py) and may set the sizes of some families (`TestConfiguration.sizes_for`:
`--sizes` still overrides them, family by family). `--ops` narrows a preset further, and
`--quick` combines with any preset: fewer iterations, the preset's sizes kept (quick sizes
for the families it leaves alone). Where a perf/bench_*.py script times the same operations,
the preset names it (`bench`); the script stays, for the variants and sizes the report does
not time (its docstring says which).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

from .. import registry
from .cases import Case, matches
from .cases_ml import IMAGE_BATCHES
from .cases_system import HOST_COST_OPS

Pick = Callable[[Case], bool]


@dataclass(frozen=True)
class Preset:
    """One named selection: which cases (`keep`), at which sizes, and its summary line."""

    name: str
    summary: str                                   # one line of `report --help`
    keep: Pick
    sizes: Dict[str, Tuple[int, ...]] = field(default_factory=dict)   # family -> sizes
    bench: Tuple[str, ...] = ()                    # perf/ scripts timing the same operations


def named(*names: str) -> Pick:
    """The cases `--ops` selects with these names (op, family, family/op, op[variant], or a
    prefix of the case id)."""
    wanted = frozenset(names)
    return lambda case: matches(case, wanted)


# shape and indexing ops: the report cases of the registry's "shape" and "indexing" families
SHAPE_CASES = tuple(r for family in ("shape", "indexing")
                    for e in registry.entries(family=family) for r in e.report)
# --preset bandwidth: the memory-bound operations perf/bench_math.py and perf/bench_ml.py time
BANDWIDTH_CASES = ("vector/add", "multiply[scalar]", "vector/exp", "vector/relu",
                   "vector/sigmoid", "reduce_sum", "reduce_max[axis=-1]", "matrix_transpose",
                   "softmax", "log_softmax", "max_pool2d[2x2]", "avg_pool2d[2x2]",
                   "batch_norm[inference]", "layer_norm", "dropout", "adam_update",
                   "sgd_update")
# --preset compute: perf/bench_ml_compute.py's conv2d and attention, bench_linear.py's layer
COMPUTE_CASES = ("conv2d[3x3 pad 1]", "flash_attention", "fused_linear_gelu", "linear")
# --preset odd: every vector and matrix case (at 1000003 elements, 1000 x 1000), the images
# ops' batch-3 and batch-64 variants at 56x56 and 224x224, and the 1000-wide rows
IMAGE_OPS = ("conv2d", "max_pool2d", "avg_pool2d", "batch_norm")
ODD_BATCHES = tuple(suffix for suffix, *_ in IMAGE_BATCHES)
ODD_ML_CASES = ("layer_norm[1000 wide]", "cross_entropy", "cross_entropy_backward")


def odd(case: Case) -> bool:
    """The cases of --preset odd (see ODD_ML_CASES above)."""
    if case.family in ("vector", "matrix") or matches(case, ODD_ML_CASES):
        return True
    return case.op in IMAGE_OPS and case.variant.endswith(ODD_BATCHES)


PRESETS: Dict[str, Preset] = {p.name: p for p in (
    Preset("backward", "every gradient case (the *_backward ops)",
           lambda c: c.op.endswith("_backward")),
    Preset("shapes", "shape and indexing ops (reshape ... scatter_add)", named(*SHAPE_CASES)),
    Preset("training", "the training steps of the examples' MLP, CNN and GPT",
           lambda c: c.family == "training"),
    Preset("host", "per-call host cost: pool allocate + free, an empty kernel's launch",
           lambda c: c.family == "transfers" and c.op in HOST_COST_OPS,
           bench=("bench_core.py",)),
    Preset("matmul", "matrix_multiply, every dtype and variant",
           named("matrix_multiply"), {"matrix": (1000, 4096)}, bench=("bench_matmul.py",)),
    Preset("bandwidth", "the memory-bound ops, at the report's largest sizes",
           named(*BANDWIDTH_CASES), {"vector": (1 << 26,), "matrix": (4096,), "ml": (128,)},
           bench=("bench_math.py", "bench_ml.py")),
    Preset("compute", "conv2d, flash_attention, fused_linear_gelu and linear",
           named(*COMPUTE_CASES), bench=("bench_ml_compute.py", "bench_linear.py")),
    Preset("odd", "sizes that are not powers of two (images 56x56 and 224x224, 1000-wide "
                  "rows)", odd,
           {"vector": (1000003,), "matrix": (1000,), "ml": (56, 224)}),
)}


def preset(name: str) -> Preset:
    """The preset called `name`; ValueError naming the known ones otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def pick(cases: List[Case], name: str) -> List[Case]:
    """The cases the preset keeps, in their order."""
    keep = preset(name).keep
    return [c for c in cases if keep(c)]


def presets_text() -> str:
    """The presets table of `report --help`."""
    width = max(len(n) for n in PRESETS)
    lines = ["presets (--preset NAME; its sizes as --sizes would set them, under its line):"]
    for p in PRESETS.values():
        lines.append(f"  {p.name:<{width}}  {p.summary}")
        if p.sizes:
            lines.append(" " * (width + 4) + "--sizes " + " ".join(
                f"{family}=" + ",".join(map(str, sizes)) for family, sizes in p.sizes.items()))
    return "\n".join(lines)
