"""run_code latency through the official e2b-code-interpreter Python SDK.

Run by `copse-rig-run-code` (rigs/src/bin/run-code.rs), which starts the gateway, sets
E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY and merges the samples this
writes into its result file. Sequential.

--mode create: one sample = Sandbox.create() then sbx.run_code("1+1");
  first_result_ms runs from the create call to the on_result callback of the
  main result, total_ms to run_code's return; sbx.kill() is not timed.
--mode roundtrip: one sandbox; one sample = one sbx.run_code("1+1").
--settle-ms: pause after the warm-up, so the pool refill the create started
  is not booting a kernel while samples are taken.

Output JSON: {"sdk", "sdk_version", "python_version", "samples": {metric:
[...]}, "errors": [...]}. Summaries are left to the rig.
"""

import argparse
import sys
import time
from importlib.metadata import version

from e2b_code_interpreter import Sandbox
from sdk_create_latency import write_output  # same folder: the shared output format

MS = 1e-6


def run_1_plus_1(sbx: Sandbox) -> tuple[int, int]:
    """run_code("1+1"); returns (on_result time, return time) in ns."""
    seen: list[int] = []

    def on_result(result) -> None:  # noqa: ANN001 - SDK Result
        if result.is_main_result and not seen:
            seen.append(time.perf_counter_ns())

    execution = sbx.run_code("1+1", on_result=on_result)
    done = time.perf_counter_ns()
    if execution.error is not None:
        raise RuntimeError(f"run_code raised {execution.error.name}: {execution.error.value}")
    if execution.text != "2" or not seen:
        raise RuntimeError(f"run_code returned {execution.text!r}, expected '2'")
    return seen[0], done


def create_sample() -> dict[str, float]:
    t0 = time.perf_counter_ns()
    sbx = Sandbox.create()
    t1 = time.perf_counter_ns()
    try:
        result_at, done = run_1_plus_1(sbx)
    finally:
        t3 = time.perf_counter_ns()
        sbx.kill()
        t4 = time.perf_counter_ns()
    return {
        "first_result_ms": (result_at - t0) * MS,
        "total_ms": (done - t0) * MS,
        "create_ms": (t1 - t0) * MS,
        "run_code_ms": (done - t1) * MS,
        "kill_ms": (t4 - t3) * MS,
    }


def measure(sample, n: int, warmup: int, pace_s: float, settle_s: float) -> tuple[dict[str, list[float]], list[str]]:
    samples: dict[str, list[float]] = {}
    errors: list[str] = []
    for i in range(warmup + n):
        if i == warmup:
            time.sleep(settle_s)
        try:
            values = sample()
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            if i >= warmup:
                errors.append(f"sample {i - warmup}: {e!r}")
            else:
                print(f"sdk warm-up sample failed: {e!r}", file=sys.stderr)
        else:
            if i >= warmup:
                for key, value in values.items():
                    samples.setdefault(key, []).append(round(value, 3))
        time.sleep(pace_s)
    return samples, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["create", "roundtrip"], required=True)
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=1, help="untimed samples first")
    ap.add_argument("--pace-ms", type=float, default=0.0, help="sleep after each sample (lets the pool refill)")
    ap.add_argument("--settle-ms", type=float, default=0.0, help="sleep after the warm-up (lets the pool refill)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    pace_s, settle_s = args.pace_ms / 1000, args.settle_ms / 1000
    if args.mode == "create":
        samples, errors = measure(create_sample, args.samples, args.warmup, pace_s, settle_s)
    else:
        sbx = Sandbox.create()
        try:

            def roundtrip_sample() -> dict[str, float]:
                t0 = time.perf_counter_ns()
                result_at, done = run_1_plus_1(sbx)
                return {"roundtrip_ms": (done - t0) * MS, "result_ms": (result_at - t0) * MS}

            samples, errors = measure(roundtrip_sample, args.samples, args.warmup, pace_s, settle_s)
        finally:
            sbx.kill()

    sdk_version = f"{version('e2b-code-interpreter')} (e2b {version('e2b')})"
    write_output(args.out, sdk_version, samples, errors, sdk="e2b-code-interpreter")
    return 0


if __name__ == "__main__":
    sys.exit(main())
