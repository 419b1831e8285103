"""The versioned schema of results.json, and a validator for it (no dependency needed).

The schema is JSON Schema (draft 2020-12) restricted to the keywords `validate` implements:
type, properties, required, additionalProperties, items, enum, minimum, $ref to #/$defs.
Each field carries a description: this module is the format's documentation, and the report
writes it next to the results as results.schema.json for tools that validate JSON Schema.
Bump SCHEMA_VERSION's major part when a field changes meaning or goes away, its minor part
when fields are added.
"""
from __future__ import annotations

from typing import Any, Dict, List

SCHEMA_VERSION = "1.1.0"
NUM = ["number", "null"]
STR = ["string", "null"]
INT = ["integer", "null"]


def _d(description: str, type_: Any, **kw: Any) -> Dict[str, Any]:
    return {"description": description, "type": type_, **kw}


STATS = _d("Timing statistics in milliseconds over the timed samples (after warm-up).",
           ["object", "null"], required=["median", "mean", "min", "max", "p20", "p80", "count"],
           properties={k: _d(f"{k} of the samples, ms", "number", minimum=0)
                       for k in ("median", "mean", "min", "max", "p20", "p80")}
           | {"count": _d("number of timed samples", "integer", minimum=1)})

ACCURACY = _d(
    "Our output against a float64 NumPy reference computed on the same inputs (rounded to the "
    "case dtype). max_rel_error is max|ours - ref| / max|ref|; passed means no message and "
    "max_rel_error <= threshold (max_error_threshold scaled by dtype/precision).",
    ["object", "null"],
    required=["max_abs_error", "max_rel_error", "threshold", "passed", "message", "reference"],
    properties={"max_abs_error": _d("max |ours - reference|; null if not finite", NUM),
                "max_rel_error": _d("max_abs_error / max |reference|; null if not finite", NUM),
                "threshold": _d("the bound max_rel_error is held to", "number", minimum=0),
                "passed": _d("whether the output is within the threshold", "boolean"),
                "message": _d("why it failed, if it did", STR),
                "reference": _d("what the output was compared with", "string")})

PEER = _d("One peer's result for the case: its timing and our ratio, or why it was skipped "
          "or failed.", "object",
          properties={"time_ms": {"$ref": "#/$defs/stats"},
                      "ratio": _d("peer median / our median: > 1 means we are faster", NUM),
                      "settings": _d("settings applied to the peer (e.g. TF32)", "object"),
                      "skipped": _d("why the peer was not run for this case", "string"),
                      "error": _d("the peer's exception, if it raised", "string")})

CASE = _d("One measured operation at one size and dtype.", "object", required=[
    "id", "family", "op", "api", "variant", "dtype", "size", "shapes", "status", "error",
    "time_ms", "cpu_time_ms", "speedup_vs_cpu", "bytes", "flops", "gbps", "gflops",
    "fraction_of_bandwidth", "fraction_of_compute", "accuracy", "peers"], properties={
    "id": _d("family/op[variant]/size/dtype, unique within a run", "string"),
    "family": _d("case family", "string",
                 enum=["vector", "matrix", "ml", "transfers", "training"]),
    "op": _d("the API method measured (training: the example model trained)", "string"),
    "api": _d("where the method lives (nn: a training step of nn, autograd and optim)",
              "string", enum=["CudaMath", "CudaML", "backend", "nn"]),
    "variant": _d("what distinguishes cases of one op (axis, precision, memory kind)", "string"),
    "dtype": _d("element type", "string"),
    "size": _d("family size: elements (vector), n (matrix, n x n), scale (ml), bytes "
               "(transfers), batch (training)", "integer", minimum=0),
    "shapes": _d("input shapes", "array", items={"type": "array", "items": {"type": "integer"}}),
    "precision": _d("requested math precision, e.g. tf32", STR),
    "status": _d("passed, failed (raised or inaccurate) or skipped (not applicable)", "string",
                 enum=["passed", "failed", "skipped"]),
    "error": _d("the failure's message: exception or accuracy", STR),
    "phase": _d("where it failed: prepare, run (the first call), accuracy, timing or cpu", STR),
    "reason": _d("why it was skipped", STR),
    "timer": _d("cuda_events (GPU timeline) or host_clock", STR),
    "l2_flushed": _d("whether the L2 was flushed before each timed call", "boolean"),
    "time_ms": {"$ref": "#/$defs/stats"},
    "cpu_time_ms": {"$ref": "#/$defs/stats"},
    "speedup_vs_cpu": _d("CPU NumPy median / our median", NUM),
    "bytes": _d("bytes the operation must move (inputs read + outputs written)", INT),
    "flops": _d("floating-point operations of the case", NUM),
    "gbps": _d("bytes / median time, GB/s", NUM),
    "gflops": _d("flops / median time, GFLOP/s", NUM),
    "arithmetic_intensity": _d("flops / bytes", NUM),
    "fraction_of_bandwidth": _d("gbps / measured copy bandwidth", NUM),
    "compute_unit": _d("the compute ceiling used: fp32, fp64, tf32_tensor, fp16_tensor, ...",
                       STR),
    "fraction_of_compute": _d("gflops / that unit's peak", NUM),
    "accuracy": ACCURACY,
    "peers": _d("peer name -> result", "object", additionalProperties=PEER),
    "notes": _d("remarks on how the case was measured", "array", items={"type": "string"}),
    "traceback": _d("the failure's traceback", "string"),
})

SCHEMA: Dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "cuda_backend/performance/results.schema.json",
    "title": "cuda-backend performance report (results.json)",
    "description": "What `cuda-backend report` measured on one device.",
    "type": "object",
    "required": ["schema_version", "generated_at", "fallback_mode", "banner", "device",
                 "ceilings", "versions", "git_commit", "configuration", "peers", "coverage",
                 "interrupted", "counts", "cases"],
    "properties": {
        "schema_version": _d("version of this schema (semantic versioning)", "string",
                             enum=[SCHEMA_VERSION]),
        "generated_at": _d("ISO 8601 time the run finished", "string"),
        "duration_s": _d("wall time of the run, seconds", "number", minimum=0),
        "fallback_mode": _d("true when there was no GPU and NumPy stood in for it", "boolean"),
        "fallback_reason": _d("why the backend is in fallback mode", STR),
        "banner": _d("the warning shown at the top of every output in fallback mode", STR),
        "device": _d("the device measured", "object",
                     required=["name", "slug", "compute_capability", "multiprocessor_count",
                               "memory_total", "l2_cache_size", "measured_bandwidth_gbps"],
                     properties={"name": _d("device name", "string"),
                                 "slug": _d("folder name of this report", "string"),
                                 "compute_capability": _d("[major, minor]", "array",
                                                          items={"type": "integer"}),
                                 "multiprocessor_count": _d("SMs", "integer"),
                                 "memory_total": _d("bytes", "integer"),
                                 "l2_cache_size": _d("bytes", "integer"),
                                 "measured_bandwidth_gbps": _d("from this run's copy", NUM)}),
        "ceilings": _d("measured memory bandwidth and computed peaks (see ceilings.py)",
                       "object", required=["memory_bandwidth_gbps", "compute"],
                       properties={"memory_bandwidth_gbps": _d("GB/s, read + write", NUM),
                                   "compute": _d("unit -> {gflops, formula}", "object")}),
        "versions": _d("cuda_backend, PyCUDA, CUDA driver, nvcc, NumPy, peers, ...", "object"),
        "git_commit": _d("commit of the checkout measured, when known", STR),
        "configuration": _d("the TestConfiguration, with effective sizes and iterations",
                            "object"),
        "timing": _d("how times were taken", "object"),
        "peers": _d("peer -> {available, version, reason, device}", "object"),
        "coverage": _d("API operation -> case ids, or why it has none", "object"),
        "interrupted": _d("true when the run was stopped early (Ctrl-C)", "boolean"),
        "counts": _d("cases by status", "object", required=["total", "passed", "failed",
                                                             "skipped"]),
        "cases": _d("every case planned and reached", "array", items={"$ref": "#/$defs/case"}),
        "outputs": _d("files written next to results.json", "object"),
        "warnings": _d("problems with the run itself", "array", items={"type": "string"}),
    },
    "$defs": {"stats": STATS, "case": CASE},
}

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value: Any, type_name: str) -> bool:
    if type_name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[type_name])


def validate(doc: Any, schema: Dict[str, Any] = SCHEMA) -> List[str]:
    """Every way doc breaks the schema, as 'path: problem' strings (empty when valid)."""
    errors: List[str] = []
    _check(doc, schema, "$", schema, errors)
    return errors


def _check(value: Any, sch: Dict[str, Any], path: str, root: Dict[str, Any],
           errors: List[str]) -> None:
    if "$ref" in sch:
        name = sch["$ref"].split("/")[-1]
        sch = root["$defs"][name]
    types = sch.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_is(value, t) for t in types):
            errors.append(f"{path}: expected {' or '.join(types)}, got {type(value).__name__}")
            return
    if "enum" in sch and value not in sch["enum"]:
        errors.append(f"{path}: {value!r} is not one of {sch['enum']}")
    if "minimum" in sch and _is(value, "number") and value < sch["minimum"]:
        errors.append(f"{path}: {value} is below the minimum {sch['minimum']}")
    if isinstance(value, dict):
        for key in sch.get("required", []):
            if key not in value:
                errors.append(f"{path}: missing required field '{key}'")
        props = sch.get("properties", {})
        extra = sch.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                _check(item, props[key], f"{path}.{key}", root, errors)
            elif extra is False:
                errors.append(f"{path}: unexpected field '{key}'")
            elif isinstance(extra, dict):
                _check(item, extra, f"{path}.{key}", root, errors)
    if isinstance(value, list) and "items" in sch:
        for i, item in enumerate(value):
            _check(item, sch["items"], f"{path}[{i}]", root, errors)


def check(doc: Any) -> None:
    """Raise ValueError listing the problems when doc does not match the schema."""
    errors = validate(doc)
    if errors:
        raise ValueError("results do not match the schema:\n  " + "\n  ".join(errors[:20]))
