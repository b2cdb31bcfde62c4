"""What copse leaves on the host, and whether any of it outlived its sandbox.

A sandbox on the Linux substrate owns, on the host:
- `<data_dir>/sandboxes/<id>/` (the mount-point and socket dirs),
- `<data_dir>/disk/<id>/` (upper and work dirs, a btrfs subvolume),
- `<data_dir>/run/<id>.sock` (the agent's socket),
- a cgroup `<subtree>/<id>` in every hierarchy (one tree on v2, one per
  controller on v1), where the subtree is `copse-<hash of the data dir>`
  (older builds used one shared `copse` subtree),
- processes in that cgroup, holding the sandbox's mount and pid namespaces;
- with a sandbox network (bridge `$COPSE_BRIDGE`): a veth `<bridge>-<hex>`
  on the host, and in the nftables table `inet copse_<bridge>` the chains
  `egress_<id>`, `ingress_<id>`, `spoof_<id>` (bound to that veth), the sets
  `allow_<id>`, `deny_<id>` and one element per verdict map.
Mounts live only inside the sandbox's mount namespace, so the host mount
table should never mention the data dir, but for one mount that is meant to
stay: the btrfs file system at `<data_dir>/disk`, where each sandbox's
writable layer `<data_dir>/disk/<id>/` is a subvolume limited to its quota.

`find_leaks` lists everything of this gateway's that does not belong to a
live sandbox. Other gateways on the host (other data dirs) have their own
subtrees and are left out; for the shared legacy subtree a `Baseline` taken
before a test excludes what was there already.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import subprocess
import time
from typing import Iterable, Optional

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
LEGACY_SUBTREE = "copse"


def is_copse_subtree(name: str) -> bool:
    return name == LEGACY_SUBTREE or name.startswith(LEGACY_SUBTREE + "-")


def subtree_for(data_dir: pathlib.Path) -> str:
    """The cgroup subtree of the gateway using `data_dir`:
    `copse-` + the first 4 bytes of sha256(canonical path), in hex."""
    digest = hashlib.sha256(os.fsencode(os.path.realpath(data_dir))).digest()
    return f"{LEGACY_SUBTREE}-{digest[:4].hex()}"


def _hierarchy_roots() -> list[pathlib.Path]:
    """v2 (`/sys/fs/cgroup`, `/sys/fs/cgroup/unified`) and every v1
    controller mount (`/sys/fs/cgroup/<ctrl>`)."""
    roots = [CGROUP_ROOT]
    try:
        roots += [e for e in CGROUP_ROOT.iterdir() if e.is_dir() and not is_copse_subtree(e.name)]
    except OSError:
        pass
    return roots


def cgroup_dirs() -> dict[tuple[str, str], list[pathlib.Path]]:
    """(subtree, sandbox id) -> its cgroup directories, across all
    hierarchies and every copse subtree."""
    found: dict[tuple[str, str], list[pathlib.Path]] = {}
    for root in _hierarchy_roots():
        try:
            subtrees = [e for e in root.iterdir() if e.is_dir() and is_copse_subtree(e.name)]
        except OSError:
            continue
        for subtree in subtrees:
            try:
                for entry in subtree.iterdir():
                    if entry.is_dir():
                        found.setdefault((subtree.name, entry.name), []).append(entry)
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


def _copse_cgroup(cgroup_text: str) -> Optional[tuple[str, str]]:
    """(subtree, sandbox id) from a /proc/<pid>/cgroup text, if the process
    is in a `.../copse[-<hash>]/<id>` cgroup of any hierarchy."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        parts = path.split("/")
        for i, part in enumerate(parts[:-1]):
            if is_copse_subtree(part) and parts[i + 1]:
                return part, parts[i + 1]
    return None


def sandbox_pids(sandbox_id: str) -> list[int]:
    """Host pids of the processes in sandbox `sandbox_id`'s copse cgroups."""
    return [pid for pid in _pids() if (_copse_cgroup(_read(f"/proc/{pid}/cgroup") or "") or ("", ""))[1] == sandbox_id]


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
    subtree: Optional[str]  # copse cgroup subtree it is in, if any
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
        subtree, sandbox = _copse_cgroup(cgroup) or (None, None)
        exe = _exe_name(pid)
        mountinfo = _read(f"/proc/{pid}/mountinfo") or ""
        in_data_dir = bool(mounts_of(data_dir, mountinfo)) and not _same_mount_ns(pid)
        if sandbox is None and not exe.startswith("copse") and not in_data_dir:
            continue
        result.append(CopseProcess(pid, subtree, sandbox, _state(pid), _cmdline(pid), in_data_dir))
    return result


def mounts_of(data_dir: pathlib.Path, mountinfo: str) -> list[str]:
    """Lines of a mount table that mention the data dir, other than a
    sandboxes' disk: `<data_dir>/disk`, or that of a gateway the suite runs
    on a data dir inside this one. Each is kept mounted on purpose, and is
    copied into every mount namespace made after it."""
    marker = str(data_dir)

    def is_disk(line: str) -> bool:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            return False
        fstype = line.split(" - ", 1)[1].split()[0]
        point = fields[4]
        return fstype == "btrfs" and point.startswith(marker + "/") and point.endswith("/disk")

    return [line for line in mountinfo.splitlines() if marker in line and not is_disk(line)]


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


def network_leaks(bridge: Optional[str], live: Iterable[str]) -> list[str]:
    """Veths, sets, chains and map elements of `bridge`'s network that
    belong to no live sandbox."""
    if not bridge:
        return []
    live = set(live)
    leaks: list[str] = []
    table = f"copse_{bridge}"
    out = subprocess.run(["nft", "-j", "list", "table", "inet", table], capture_output=True, text=True)
    objects = json.loads(out.stdout)["nftables"] if out.returncode == 0 else []
    per_sandbox = re.compile(r"^(egress|ingress|spoof|allow|deny)_(.+)$")
    bound_veths = set()
    for obj in objects:
        kind = next(iter(obj))
        if kind not in ("chain", "set", "map"):
            continue
        body = obj[kind]
        m = per_sandbox.match(body["name"])
        if m and m.group(2) not in live:
            leaks.append(f"nft {kind} {table} {body['name']}")
        if kind == "map":
            for element in body.get("elem", []):
                target = element[1]["jump"]["target"] if isinstance(element, list) else ""
                sid = target.split("_", 1)[-1]
                if sid not in live:
                    leaks.append(f"nft map element {table} {body['name']} -> {target}")
    # nft's JSON (1.0.6) leaves out a chain's device; the text has it.
    text = subprocess.run(["nft", "list", "table", "inet", table], capture_output=True, text=True).stdout
    for sid, dev in re.findall(r'chain spoof_(\S+) \{\s*type filter hook ingress device "([^"]+)"', text):
        if sid in live:
            bound_veths.add(dev)
    veth = re.compile(rf"^{re.escape(bridge)}-[0-9a-f]+$")
    for name in sorted(os.listdir("/sys/class/net")):
        if veth.match(name) and name not in bound_veths:
            leaks.append(f"veth {name} of no live sandbox")
    return leaks


@dataclasses.dataclass
class Baseline:
    """What was in the shared legacy `copse` subtree before (other
    gateways' sandboxes, not ours to judge)."""

    legacy_ids: set[str]
    namespaces: set[str]


def baseline(data_dir: pathlib.Path) -> Baseline:
    procs = [p for p in copse_processes(data_dir) if not p.in_data_dir]
    namespaces: set[str] = set()
    for p in procs:
        namespaces |= held_namespaces(p.pid)
    legacy = {sid for (subtree, sid) in cgroup_dirs() if subtree == LEGACY_SUBTREE}
    legacy |= {p.sandbox for p in procs if p.subtree == LEGACY_SUBTREE and p.sandbox}
    return Baseline(legacy_ids=legacy, namespaces=namespaces)


def find_leaks(
    data_dir: pathlib.Path,
    live: Iterable[str],
    before: Optional[Baseline] = None,
    gateway_pid: Optional[int] = None,
) -> list[str]:
    """Everything of this gateway's on the host that belongs to no live
    sandbox."""
    live = set(live)
    before = before or Baseline(set(), set())
    ours_subtree = subtree_for(data_dir)
    leaks: list[str] = []

    def ours(subtree: Optional[str], sid: Optional[str]) -> bool:
        if subtree == ours_subtree:
            return True
        return subtree == LEGACY_SUBTREE and sid not in before.legacy_ids

    for kind, parent in (("sandbox dir", data_dir / "sandboxes"), ("sandbox disk", data_dir / "disk")):
        if parent.is_dir():
            for entry in sorted(parent.iterdir()):
                # Persistent volumes outlive every sandbox (test_volumes.py
                # deletes its own).
                if entry.name not in live and entry.name != ".volumes":
                    leaks.append(f"{kind} {entry}")

    run = data_dir / "run"
    if run.is_dir():
        for entry in sorted(run.iterdir()):
            sid = entry.name[: -len(".sock")] if entry.name.endswith(".sock") else entry.name
            if sid not in live:
                kind = "socket" if entry.is_socket() else "file"
                leaks.append(f"{kind} in run dir {entry}")

    for (subtree, sid), dirs in sorted(cgroup_dirs().items()):
        if sid not in live and ours(subtree, sid):
            leaks.extend(f"cgroup {d}" for d in dirs)

    live_namespaces: set[str] = set()
    stray_namespaces: dict[str, str] = {}
    for p in copse_processes(data_dir):
        mine = p.in_data_dir or ours(p.subtree, p.sandbox)
        if not mine and p.pid != gateway_pid:
            continue
        if p.sandbox is not None and p.sandbox in live:
            live_namespaces |= held_namespaces(p.pid)
            continue
        if p.sandbox is not None:
            leaks.append(f"process {p.pid} [{p.state}] in cgroup {p.subtree}/{p.sandbox}: {p.cmdline!r}")
            continue
        if p.in_data_dir:
            leaks.append(f"process {p.pid} [{p.state}] outside any copse cgroup, mounts of {data_dir}: {p.cmdline!r}")
            continue
        for ns in held_namespaces(p.pid):
            stray_namespaces.setdefault(ns, f"process {p.pid} {p.cmdline!r}")

    for ns, holder in sorted(stray_namespaces.items()):
        if ns not in live_namespaces and ns not in before.namespaces:
            leaks.append(f"namespace {ns} held by {holder}")

    for line in mounts_of(data_dir, _read("/proc/self/mountinfo") or ""):
        leaks.append(f"host mount: {line}")

    leaks.extend(network_leaks(os.environ.get("COPSE_BRIDGE"), live))
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


def unnamed_layers(data_dir: pathlib.Path) -> list[str]:
    """Snapshot layers (`<data_dir>/layers/<layer>`) that no snapshot and no
    sandbox names any more: each should have been removed with the last
    thing that named it."""
    import json

    layers_dir = data_dir / "layers"
    if not layers_dir.exists():
        return []
    named: set[str] = set()
    for snapshot in (data_dir / "snapshots").glob("*.json"):
        named |= set(json.loads(snapshot.read_text())["layers"])
    for base in (data_dir / "sandboxes").glob("*/base.json"):
        named |= set(json.loads(base.read_text())["layers"])
    return sorted(p.name for p in layers_dir.iterdir() if p.name != ".lock" and p.name not in named)
