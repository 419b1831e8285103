"""`cuda-backend report --preset NAME`, `--sizes` and `--list` (performance/presets.py,
config.parse_sizes), and the cases of sizes that are not powers of two (`--preset odd`):
what each preset plans (nothing runs but the one fallback-mode test at quick sizes)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cuda_backend import cli
from cuda_backend.driver import load_driver
from cuda_backend.performance import cases_math, cases_ml, presets
from cuda_backend.performance.cases import matches
from cuda_backend.performance.config import TestConfiguration as Config
from cuda_backend.performance.config import parse_sizes
from cuda_backend.performance.tester import CudaPerformanceTester

fallback_only = pytest.mark.skipif(load_driver()[0] is not None,
                                   reason="in-process fallback run; on a GPU test_report.py's "
                                          "subprocess runs cover the report")
# the variants --preset odd adds to the tables, as --ops names them
NEW_CASES = [f"{op}[{base}{suffix}]" for suffix, *_ in cases_ml.IMAGE_BATCHES
             for op, base in (("conv2d", "3x3 pad 1"), ("max_pool2d", "2x2"),
                              ("avg_pool2d", "2x2"), ("batch_norm", "inference"))]
NEW_CASES += ["layer_norm[1000 wide]", "matrix_multiply[skinny (3,4n+1)@(4n+1,n)]"]


def planned(**kw):
    return CudaPerformanceTester(Config(progress=False, **kw)).planned_cases()


@pytest.fixture(scope="module")
def full_plan():
    return planned()


@pytest.mark.parametrize("name", list(presets.PRESETS))
def test_every_preset_plans_cases_and_names_only_existing_ones(name):
    cases = planned(preset=name)
    assert cases, name
    p = presets.PRESETS[name]
    for c in cases:
        assert c.size in p.sizes.get(c.family, (c.size,)), c.id
    named = {"shapes": presets.SHAPE_CASES, "bandwidth": presets.BANDWIDTH_CASES,
             "compute": presets.COMPUTE_CASES, "odd": presets.ODD_ML_CASES}.get(name, ())
    for n in named:       # a renamed op or variant must not leave a preset empty-handed
        assert any(matches(c, {n}) for c in cases), (name, n)


def test_backward_shapes_training_and_host_presets(full_plan):
    by_id = {c.id for c in full_plan}
    backward = {c.id for c in planned(preset="backward")}
    assert backward == {i for i in by_id if i.split("/")[1].split("[")[0].endswith("_backward")}
    shapes = {c.op for c in planned(preset="shapes")}
    assert {"reshape", "permute", "concatenate", "take", "gather", "scatter_add",
            "where"} <= shapes and "matrix_multiply" not in shapes
    assert {c.family for c in planned(preset="training")} == {"training"}
    assert [c.op for c in planned(preset="host")] == ["allocate_memory", "launch_kernel"]


def test_ops_narrow_a_preset_and_sizes_resize_it():
    cases = planned(preset="matmul", operations=["matrix_multiply[tf32]"])
    assert [c.id for c in cases] == ["matrix/matrix_multiply[tf32]/1000/float32",
                                     "matrix/matrix_multiply[tf32]/4096/float32"]
    cases = planned(preset="matmul", operations=["matrix_multiply[tf32]"],
                    sizes={"matrix": [300]})
    assert [c.id for c in cases] == ["matrix/matrix_multiply[tf32]/300/float32"]


def test_quick_keeps_the_presets_sizes():
    cfg = Config(preset="odd", quick=True)
    assert cfg.sizes_for("ml") == [56, 224] and cfg.sizes_for("vector") == [1000003]
    assert cfg.sizes_for("transfers") == Config(quick=True).sizes_for("transfers")
    assert Config(preset="odd", sizes={"ml": [8]}).sizes_for("ml") == [8]
    assert cfg.to_dict()["preset"] == "odd"
    with pytest.raises(ValueError, match="unknown preset 'nope'; known: backward"):
        Config(preset="nope")


# -- the shapes no one named (--preset odd) -------------------------------------------------
def test_odd_preset_plans_the_named_shapes():
    ids = {c.id for c in planned(preset="odd")}
    for want in ("ml/conv2d[3x3 pad 1 N=3]/224/float32", "ml/conv2d[3x3 pad 1 N=64]/56/float32",
                 "ml/max_pool2d[2x2 N=3]/56/float32", "ml/avg_pool2d[2x2 N=64]/56/float32",
                 "ml/batch_norm[inference N=3]/224/float32",
                 "ml/layer_norm[1000 wide]/224/bfloat16", "ml/cross_entropy[mean]/56/float32",
                 "matrix/softmax/1000/float32", "matrix/reduce_sum[axis=-1]/1000/float32",
                 "matrix/matrix_multiply/1000/float32",
                 "matrix/matrix_multiply[skinny (3,4n+1)@(4n+1,n)]/1000/float32",
                 "vector/add/1000003/float32", "vector/reduce_sum/1000003/float32"):
        assert want in ids, want
    assert "ml/conv2d[3x3 pad 1 N=64]/224/float32" not in ids      # its max_size: 64


@pytest.mark.parametrize("op, variant, size, shapes", [
    ("conv2d", "3x3 pad 1 N=3", 224, [(3, 64, 224, 224), (64, 64, 3, 3)]),
    ("conv2d", "3x3 pad 1 N=64", 56, [(64, 32, 56, 56), (32, 32, 3, 3)]),
    ("batch_norm", "inference N=64", 56, [(64, 32, 56, 56)] + [(32,)] * 4),
    ("layer_norm", "1000 wide", 56, [(1568, 1000), (1000,), (1000,)]),
    ("matrix_multiply", "skinny (3,4n+1)@(4n+1,n)", 1024, [(3, 4097), (4097, 1024)]),
])
def test_new_variants_draw_their_shapes(op, variant, size, shapes):
    (d,) = [d for d in cases_math.MATH_OPS + cases_ml.ML_OPS
            if (d.op, d.variant) == (op, variant)]
    arrays = d.inputs(np.random.default_rng(0), size)
    assert [a.shape for a in arrays] == shapes


def test_every_odd_case_has_a_reference_and_a_pytorch_peer():
    picked = {(c.op, c.variant) for c in planned(preset="odd")}
    defs = [d for d in cases_math.MATH_OPS + cases_ml.ML_OPS if (d.op, d.variant) in picked]
    assert len(defs) >= 60
    for d in defs:
        assert d.cpu is not None or d.reference is not None, d.op
        assert d.torch is not None or d.torch_factory is not None, (d.op, d.variant)


@fallback_only
def test_new_cases_run_and_pass_in_fallback_quick(tmp_path, capsys):
    rc = cli.main(["report", "--quick", "--no-peers", "--out", str(tmp_path), "--ops"]
                  + NEW_CASES)
    assert rc == 0, capsys.readouterr().err
    (folder,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    doc = json.loads((folder / "results.json").read_text())
    assert {f"{c['op']}[{c['variant']}]" for c in doc["cases"]} == set(NEW_CASES)
    assert all(c["status"] == "passed" for c in doc["cases"]), \
        [(c["id"], c["error"]) for c in doc["cases"] if c["status"] != "passed"]


# -- the command line ----------------------------------------------------------------------------
def test_parse_sizes():
    assert parse_sizes(["matrix=1000,3000", "vector=2^20", "ml=56"]) == {
        "matrix": [1000, 3000], "vector": [1 << 20], "ml": [56]}
    for bad, message in (("matrx=3", "FAMILY one of vector, matrix, ml, transfers"),
                         ("matrix", "write FAMILY=N"), ("ml=0", "'0' is not a positive"),
                         ("ml=56,", "'' is not a positive"), ("ml=2^x", "'2^x' is not")):
        with pytest.raises(ValueError) as exc:
            parse_sizes([bad])
        assert message in str(exc.value)


def test_list_prints_the_selected_case_ids(capsys):
    rc = cli.main(["report", "--list", "--quick", "--ops", "vector_add", "--sizes",
                   "vector=1000,2^10"])
    assert rc == 0
    assert capsys.readouterr().out.splitlines() == ["vector/vector_add/1000/float32",
                                                    "vector/vector_add/1024/float32"]
    assert cli.main(["report", "--list", "--preset", "host"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "transfers/allocate_memory[1 MiB + free_memory]/1048576/uint8",
        "transfers/launch_kernel[empty kernel]/1/float32"]


def test_bad_sizes_and_presets_exit_2(capsys):
    assert cli.main(["report", "--list", "--sizes", "matrx=3"]) == cli.EXIT_USAGE
    assert "cuda-backend report: --sizes 'matrx=3'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["report", "--preset", "nope"])
    assert exc.value.code == cli.EXIT_USAGE
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_help_lists_every_preset(capsys):
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    out = capsys.readouterr().out
    for p in presets.PRESETS.values():
        assert f"  {p.name:<9}  {p.summary}" in out
    assert "--sizes vector=1000003 matrix=1000 ml=56,224" in out
    for option in ("--preset NAME", "--sizes FAMILY=N[,N...]", "--compare OLD", "--list"):
        assert option in out
