"""The benches' shared report tail: the JSON where asked, then the section printed; a failing renderer loses no JSON."""

from __future__ import annotations

import json

import pytest

from bench.common import report


def test_the_result_goes_to_the_json_path_and_its_section_to_stdout(tmp_path, capsys):
    path = tmp_path / "out" / "bench.json"
    report.finish({"rows": [1, 2]}, path, lambda r: f"{len(r['rows'])} rows")
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert capsys.readouterr().out == "2 rows\n"


def test_a_bench_without_a_renderer_prints_its_json_and_writes_none_unasked(capsys):
    report.finish({"a": 1}, None)
    assert json.loads(capsys.readouterr().out) == {"a": 1}


def test_the_json_is_written_before_a_renderer_that_fails(tmp_path):
    path = tmp_path / "bench.json"

    def broken(result: dict) -> str:
        raise KeyError("machine")

    with pytest.raises(KeyError):
        report.finish({"a": 1}, path, broken)
    assert json.loads(path.read_text()) == {"a": 1}


def test_the_measured_line_names_the_machine_only_when_the_result_has_one():
    host = {"date": "d", "cpu": "c", "cores": 2, "ram_gb": 1.0, "load_average": (1.0, 1.0, 1.0), "versions": {}}
    assert report.measured({"machine": host}).startswith("Measured d; c, 2 cores")
    assert report.measured({}) == ""
