"""Create-to-first-exec latency through the official e2b Python SDK.

Run by `copse-rig-create` (rigs/src/bin/create-latency.rs), which starts the gateway,
sets E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY and merges the samples this
writes into its result file. Sequential: one sample = Sandbox.create() then
sbx.commands.run("true"); sbx.kill() afterwards is not timed.

Output JSON: {"sdk_version", "python_version", "samples": {"total_ms": [...],
"create_ms": [...], "exec_ms": [...], "kill_ms": [...]}, "errors": [...]}.
Summaries are left to the rig.
"""

import argparse
import json
import platform
import sys
import time
from importlib.metadata import version

from e2b import Sandbox


def one() -> tuple[float, float, float, float]:
    t0 = time.perf_counter_ns()
    sbx = Sandbox.create()
    t1 = time.perf_counter_ns()
    try:
        result = sbx.commands.run("true")
        t2 = time.perf_counter_ns()
        if result.exit_code != 0:
            raise RuntimeError(f"`true` exited {result.exit_code}")
    finally:
        t3 = time.perf_counter_ns()
        sbx.kill()
        t4 = time.perf_counter_ns()
    ms = 1e-6
    return (t2 - t0) * ms, (t1 - t0) * ms, (t2 - t1) * ms, (t4 - t3) * ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=1, help="untimed samples first (imports, connections)")
    ap.add_argument("--pace-ms", type=float, default=0.0, help="sleep after each sample (lets a warm pool refill)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    samples: dict[str, list[float]] = {"total_ms": [], "create_ms": [], "exec_ms": [], "kill_ms": []}
    errors: list[str] = []
    for _ in range(args.warmup):
        try:
            one()
        except Exception as e:  # noqa: BLE001 - warm-up failures show up again below
            print(f"sdk warm-up sample failed: {e!r}", file=sys.stderr)
        time.sleep(args.pace_ms / 1000)
    for _ in range(args.samples):
        try:
            total, create, run, kill = one()
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            errors.append(repr(e))
        else:
            for key, value in zip(samples, (total, create, run, kill)):
                samples[key].append(round(value, 3))
        time.sleep(args.pace_ms / 1000)

    write_output(args.out, version("e2b"), samples, errors)
    return 0


def write_output(path: str, sdk_version: str, samples: dict, errors: list[str], sdk: str | None = None) -> None:
    """The JSON the rigs read (copse_rig_common::SdkRun); shared with sdk_run_code.py."""
    out = {"sdk_version": sdk_version, "python_version": platform.python_version(), "samples": samples, "errors": errors}
    if sdk is not None:
        out["sdk"] = sdk
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    sys.exit(main())
