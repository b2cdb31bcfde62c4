"""Every committed benchmark result follows benchmarks/schema.json, and its
summaries are what the shared statistics library computes from its raw
samples (so no rig summarises on its own, and nothing was edited by hand)."""

import json
import math
import pathlib
import re

import jsonschema
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "benchmarks" / "schema.json").read_text())
# `tuned/`: results measured under a host setting copse does not make,
# kept apart so no headline figure comes from them.
RESULTS = [path for kind in ("results", "tuned") for path in sorted((ROOT / "benchmarks" / kind).glob("*.json"))]


def percentile(sorted_values, pct):
    """Linear interpolation between closest ranks (numpy's default)."""
    rank = pct / 100 * (len(sorted_values) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def test_there_are_results():
    assert RESULTS, "no committed result files"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_result_matches_schema(path):
    result = json.loads(path.read_text())
    jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.FormatChecker()).validate(result)
    assert path.name.startswith(result["rig"] + "-"), "file name must start with the rig name"
    if result["git"]["commit"]:
        assert re.search(r"-" + result["git"]["commit"][:7], path.name), "file name carries the short commit"
    names = [s["name"] for s in result["scenarios"]]
    assert len(names) == len(set(names)), "scenario names are unique"
    for metric in result["clock"]:
        assert any(metric in s["samples"] for s in result["scenarios"]), f"clock defines unrecorded {metric}"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_summaries_derive_from_samples(path):
    result = json.loads(path.read_text())
    for sc in result["scenarios"]:
        lengths = {len(v) for v in sc["samples"].values()}
        assert len(lengths) <= 1, f"{sc['name']}: sample arrays are not index-aligned"
        for metric, values in sc["samples"].items():
            present = sorted(v for v in values if v is not None)
            if not present:
                assert metric not in sc["summary"]
                continue
            s = sc["summary"][metric]
            assert s["n"] == len(present)
            expected = {
                "min": present[0],
                "max": present[-1],
                "p50": percentile(present, 50),
                "p95": percentile(present, 95),
                "p99": percentile(present, 99),
                "mean": sum(present) / len(present),
            }
            for stat, value in expected.items():
                # Samples are stored rounded to 0.001 ms, summaries computed before rounding.
                assert abs(s[stat] - value) <= 0.002, f"{sc['name']}.{metric}.{stat}: {s[stat]} vs {value}"
        if sc["wall_ms"] is not None and sc["throughput_per_s"] is not None:
            n = max(lengths) if lengths else 0
            # wall_ms is stored rounded; throughput was computed from the exact wall.
            assert math.isclose(sc["throughput_per_s"], n * 1000 / sc["wall_ms"], rel_tol=1e-4, abs_tol=0.002)
