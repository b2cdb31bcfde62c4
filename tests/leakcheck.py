"""What copse leaves on the host, and whether any of it outlived its sandbox.

A sandbox on the Linux substrate owns, on the host:
- `<data_dir>/sandboxes/<id>/` (upper, work and mount-point dirs),
- `<data_dir>/run/<id>.sock` (the agent's socket),
- a cgroup `copse/<id>` in every hierarchy (one tree on v2, one per
  controller on v1),
- processes in that cgroup, holding the sandbox's mount and pid namespaces.
Mounts live only inside the sandbox's mount namespace, so the host mount
table should never mention the data dir.

`find_leaks` lists everything of copse that does not belong to a live
sandbox. cgroups and processes are host-wide (another copse with another
data dir may run on the same machine), so a `Baseline` taken before a test
excludes what was there already.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from typing import Iterable, Optional

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
SUBTREE = "copse"


def _cgroup_parents() -> list[pathlib.Path]:
    """Every `copse` subtree, in v2 (`/sys/fs/cgroup/copse`,
    `/sys/fs/cgroup/unified/copse`) and v1 (`/sys/fs/cgroup/<ctrl>/copse`)
    layouts alike."""
    parents = [CGROUP_ROOT / SUBTREE]
    try:
        for entry in CGROUP_ROOT.iterdir():
            if entry.is_dir() and entry.name != SUBTREE:
                parents.append(entry / SUBTREE)
    except OSError:
        pass
    return [p for p in parents if p.is_dir()]


def cgroup_dirs() -> dict[str, list[pathlib.Path]]:
    """Sandbox id -> its cgroup directories, across all hierarchies."""
    found: dict[str, list[pathlib.Path]] = {}
    for parent in _cgroup_parents():
        try:
            for entry in parent.iterdir():
                if entry.is_dir():
                    found.setdefault(entry.name, []).append(entry)
        except OSError:
            pass
    return found


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "r", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _copse_cgroup_id(cgroup_text: str) -> Optional[str]:
    """The sandbox id in a /proc/<pid>/cgroup text, if the process is in a
    `.../copse/<id>` cgroup of any hierarchy."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        parts = path.split("/")
        for i, part in enumerate(parts[:-1]):
            if part == SUBTREE and parts[i + 1]:
                return parts[i + 1]
    return None


def _state(pid: int) -> str:
    stat = _read(f"/proc/{pid}/stat") or ""
    rest = stat[stat.rfind(")") + 2 :] if ")" in stat else ""
    return rest[:1] or "?"


def _cmdline(pid: int) -> str:
    raw = _read(f"/proc/{pid}/cmdline") or ""
    return raw.replace("\0", " ").strip()


def _exe_name(pid: int) -> str:
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).replace(" (deleted)", "")
    except OSError:
        return ""


@dataclasses.dataclass
class CopseProcess:
    pid: int
    sandbox: Optional[str]  # id from its copse cgroup, None if not in one
    state: str
    cmdline: str
    in_data_dir: bool  # its mount table mentions the data dir


def copse_processes(data_dir: pathlib.Path) -> list[CopseProcess]:
    """Processes that are copse's: in a copse cgroup, or running a copse
    binary, or with a mount table that mentions the data dir."""
    marker = str(data_dir)
    result = []
    for pid in _pids():
        cgroup = _read(f"/proc/{pid}/cgroup")
        if cgroup is None:
            continue
        sandbox = _copse_cgroup_id(cgroup)
        exe = _exe_name(pid)
        mountinfo = _read(f"/proc/{pid}/mountinfo") or ""
        in_data_dir = marker in mountinfo and not _same_mount_ns(pid)
        if sandbox is None and not exe.startswith("copse") and not in_data_dir:
            continue
        result.append(CopseProcess(pid, sandbox, _state(pid), _cmdline(pid), in_data_dir))
    return result


def _ns(pid: int | str, kind: str) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _same_mount_ns(pid: int) -> bool:
    return _ns(pid, "mnt") == _ns("self", "mnt")


def held_namespaces(pid: int) -> set[str]:
    """Mount and pid namespaces a process is in or holds an fd to, other
    than the host's (this test process's)."""
    host = {_ns("self", k) for k in ("mnt", "pid", "pid_for_children")}
    held = set()
    for kind in ("mnt", "pid", "pid_for_children"):
        ns = _ns(pid, kind)
        if ns:
            held.add(ns.replace("pid_for_children", "pid"))
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(("mnt:[", "pid:[")):
                held.add(target)
    except OSError:
        pass
    host = {h.replace("pid_for_children", "pid") for h in host if h}
    return held - host


@dataclasses.dataclass
class Baseline:
    """What was on the host before: cgroups and processes of other copse
    instances, which are not ours to judge."""

    cgroup_ids: set[str]
    process_sandboxes: set[str]
    namespaces: set[str]


def baseline(data_dir: pathlib.Path) -> Baseline:
    procs = [p for p in copse_processes(data_dir) if not p.in_data_dir]
    namespaces: set[str] = set()
    for p in procs:
        namespaces |= held_namespaces(p.pid)
    return Baseline(
        cgroup_ids=set(cgroup_dirs()),
        process_sandboxes={p.sandbox for p in procs if p.sandbox},
        namespaces=namespaces,
    )


def find_leaks(
    data_dir: pathlib.Path,
    live: Iterable[str],
    before: Optional[Baseline] = None,
    gateway_pid: Optional[int] = None,
) -> list[str]:
    """Everything of copse on the host that belongs to no live sandbox."""
    live = set(live)
    before = before or Baseline(set(), set(), set())
    leaks: list[str] = []

    sandboxes = data_dir / "sandboxes"
    if sandboxes.is_dir():
        for entry in sorted(sandboxes.iterdir()):
            if entry.name not in live:
                leaks.append(f"sandbox dir {entry}")

    run = data_dir / "run"
    if run.is_dir():
        for entry in sorted(run.iterdir()):
            sid = entry.name[: -len(".sock")] if entry.name.endswith(".sock") else entry.name
            if sid not in live:
                kind = "socket" if entry.is_socket() else "file"
                leaks.append(f"{kind} in run dir {entry}")

    for sid, dirs in sorted(cgroup_dirs().items()):
        if sid not in live and sid not in before.cgroup_ids:
            leaks.extend(f"cgroup {d}" for d in dirs)

    live_namespaces: set[str] = set()
    stray_namespaces: dict[str, str] = {}
    for p in copse_processes(data_dir):
        ours = p.in_data_dir or (p.sandbox is not None and p.sandbox not in before.process_sandboxes)
        if p.sandbox in live:
            live_namespaces |= held_namespaces(p.pid)
            continue
        if p.sandbox is not None and ours:
            leaks.append(f"process {p.pid} [{p.state}] in cgroup copse/{p.sandbox}: {p.cmdline!r}")
            continue
        if p.sandbox is None and p.in_data_dir:
            leaks.append(f"process {p.pid} [{p.state}] outside any copse cgroup, mounts of {data_dir}: {p.cmdline!r}")
            continue
        if p.sandbox is None and (p.pid == gateway_pid or ours):
            for ns in held_namespaces(p.pid):
                stray_namespaces.setdefault(ns, f"process {p.pid} {p.cmdline!r}")

    for ns, holder in sorted(stray_namespaces.items()):
        if ns not in live_namespaces and ns not in before.namespaces:
            leaks.append(f"namespace {ns} held by {holder}")

    marker = str(data_dir)
    mountinfo = _read("/proc/self/mountinfo") or ""
    for line in mountinfo.splitlines():
        if marker in line:
            leaks.append(f"host mount: {line}")

    return leaks


def assert_no_leaks(
    data_dir: pathlib.Path,
    live: Iterable[str],
    before: Optional[Baseline] = None,
    gateway_pid: Optional[int] = None,
    settle: float = 10.0,
) -> None:
    """Waits up to `settle` seconds (teardown may finish just after the API
    answered) for every leak to go, then fails listing what is left."""
    live = set(live)
    deadline = time.monotonic() + settle
    while True:
        leaks = find_leaks(data_dir, live, before, gateway_pid)
        if not leaks or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not leaks, f"{len(leaks)} leftovers of dead sandboxes (live: {sorted(live)}):\n" + "\n".join(leaks[:50])
