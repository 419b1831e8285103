"""The autotuner with a stand-in backend whose "GPU" times are set by the test: the fastest
config wins, a failing config loses instead of crashing, choices are kept in memory and on
disk (atomically written JSON), and a repeated call does not time again."""
from __future__ import annotations

import contextlib
import json
import types

import pytest

from cuda_backend.autotune import Autotuner
from cuda_backend.errors import CudaBackendError


class _Clock:
    """Fake driver: events read a clock that run(cfg) advances by the config's cost."""

    def __init__(self):
        self.now = 0.0
        drv = self

        class Event:
            def record(self, stream=None):
                self.t = drv.now

            def synchronize(self):
                pass

            def time_since(self, other):
                return self.t - other.t

        self.Event = Event
        self.Context = types.SimpleNamespace(synchronize=lambda: None)


class _Backend:
    is_available = True

    def __init__(self):
        self._drv = _Clock()
        self.devices = [types.SimpleNamespace(name="Fake GPU")]

    @contextlib.contextmanager
    def activate(self, device_id):
        yield


CANDS = [{"tile": 32}, {"tile": 64}, {"tile": 128}]
COST = {32: 3.0, 64: 1.0, 128: 2.0}


@pytest.fixture(autouse=True)
def _no_repeat_cap(monkeypatch):
    monkeypatch.delenv("CUDA_BACKEND_AUTOTUNE_REPEATS", raising=False)


def make(tmp_path):
    b = _Backend()
    calls = []

    def run(cfg):
        calls.append(cfg["tile"])
        if COST[cfg["tile"]] is None:
            raise RuntimeError("launch failed")
        b._drv.now += COST[cfg["tile"]]

    return Autotuner(b, path=str(tmp_path / "tune.json")), run, calls


def test_fastest_wins_and_is_remembered(tmp_path):
    tuner, run, calls = make(tmp_path)
    assert tuner.pick("op", ("f32", "large"), CANDS, run) == {"tile": 64}
    timed = len(calls)
    assert timed == 3 * 4           # warm-up + 3 repeats per candidate
    choice = tuner.pick("op", ("f32", "large"), CANDS, run)
    assert choice == {"tile": 64} and len(calls) == timed      # no second timing
    choice["tile"] = 1                                          # callers get a copy
    assert tuner.pick("op", ("f32", "large"), CANDS, run) == {"tile": 64}
    doc = json.loads((tmp_path / "tune.json").read_text())
    (key, entry), = doc["choices"].items()
    assert "Fake GPU|op|" in key and entry["config"] == {"tile": 64}


def test_saved_choice_is_used_by_a_new_tuner(tmp_path):
    tuner, run, calls = make(tmp_path)
    tuner.pick("op", "medium", CANDS, run)
    fresh, run2, calls2 = make(tmp_path)
    assert fresh.pick("op", "medium", CANDS, run2) == {"tile": 64} and calls2 == []


def test_another_candidate_list_is_timed_again(tmp_path):
    tuner, run, calls = make(tmp_path)
    tuner.pick("op", "c", CANDS, run)
    n = len(calls)
    assert tuner.pick("op", "c", CANDS[:1] + CANDS[2:], run) == {"tile": 128}
    assert len(calls) > n


def test_a_failing_config_loses(tmp_path, monkeypatch):
    monkeypatch.setitem(COST, 64, None)
    tuner, run, _ = make(tmp_path)
    assert tuner.pick("op", "x", CANDS, run) == {"tile": 128}


def test_every_config_failing_is_a_typed_error(tmp_path, monkeypatch):
    for t in COST:
        monkeypatch.setitem(COST, t, None)
    tuner, run, _ = make(tmp_path)
    with pytest.raises(CudaBackendError, match="every candidate"):
        tuner.pick("op", "x", CANDS, run)


def test_unhashable_shape_class_still_works(tmp_path):
    tuner, run, calls = make(tmp_path)
    assert tuner.pick("op", ["list", 1], CANDS, run) == {"tile": 64}
    n = len(calls)
    assert tuner.pick("op", ["list", 1], CANDS, run) == {"tile": 64} and len(calls) == n


def test_repeat_cap_from_the_environment(tmp_path, monkeypatch):
    """CUDA_BACKEND_AUTOTUNE_REPEATS=1 (sanitizer runs): each candidate runs warm-up + 1."""
    monkeypatch.setenv("CUDA_BACKEND_AUTOTUNE_REPEATS", "1")
    tuner, run, calls = make(tmp_path)
    assert tuner.pick("op", "cls", CANDS, run, repeats=10) == {"tile": 64}
    assert len(calls) == 3 * 2


# -- a damaged file: ignored with a warning, then replaced ------------------------------------
@pytest.mark.parametrize("text", ["null", "[]", '"a string"', "42", "{truncated",
                                  '{"version": 2, "choices": {}}', '{"version": 1, "choices": []}'],
                         ids=["null", "list", "string", "number", "truncated", "version-2",
                              "choices-list"])
def test_a_file_that_is_not_a_version_1_object_is_ignored_and_rewritten(tmp_path, text):
    (tmp_path / "tune.json").write_text(text)
    tuner, run, calls = make(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"ignoring the autotune file .*tune\.json"):
        assert tuner.pick("op", "cls", CANDS, run) == {"tile": 64}
    assert len(calls) == 3 * 4                                  # timed, as with no file
    doc = json.loads((tmp_path / "tune.json").read_text())
    (entry,) = doc["choices"].values()
    assert doc["version"] == 1 and entry["config"] == {"tile": 64}


def test_malformed_entries_are_dropped(tmp_path):
    """An entry under the very key of a choice that is not {"config": {...}} is timed again
    instead of failing in the lookup."""
    from cuda_backend.autotune import _digest
    key = f"Fake GPU|op|{json.dumps('cls')}|{_digest(CANDS)}"
    for bad in ("x", None, {"config": "tile"}, {"ms": 1.0}):
        (tmp_path / "tune.json").write_text(json.dumps({"version": 1, "choices": {key: bad}}))
        tuner, run, calls = make(tmp_path)
        assert tuner.pick("op", "cls", CANDS, run) == {"tile": 64} and len(calls) == 3 * 4
        assert json.loads((tmp_path / "tune.json").read_text())["choices"][key]["config"] == \
            {"tile": 64}
