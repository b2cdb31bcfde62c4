"""The dependency guard: every program the code starts on the host is named
in scripts/host-programs, and every program named there for serving or
testing is present after scripts/bootstrap — installed by it, or part of
Debian's base system or the README's prerequisites. A tool someone adds to
the code without adding it there, or that a fresh machine would not have,
fails here instead of on a newcomer's machine."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIST = ROOT / "scripts" / "host-programs"

# Where code starts programs: Rust's Command::new and the plans' Cmd/Step
# constructors; Python's subprocess calls and the network suite's sh().
RUST_LITERAL = re.compile(r'\b(?:Command|Cmd|Step)::new\(\s*"([^"]+)"')
RUST_COMPUTED = re.compile(r'\bCommand::new\(\s*([^"\s)][^)]*)\)')
PY_LITERAL = re.compile(r'(?:subprocess\.(?:run|Popen|check_output|check_call)\(\s*\[|\bsh\()\s*"([^"]+)"')

# Call sites whose program is computed, and the programs each can start.
# An empty set: the program runs inside a sandbox or guest, not on the host.
COMPUTED_SITES = {
    ("jails/linux/src/rootfs.rs", "&step.program"): {"debootstrap", "chroot"},
    ("jails/linux/src/checkpoint.rs", "binary"): {"criu"},
    ("jails/linux/src/checkpoint.rs", "&self.binary"): {"criu"},
    ("jails/linux/src/lazy_pages.rs", "criu"): {"criu"},
    ("jails/jailer/src/linux/boot.rs", "&plan.criu"): {"criu"},
    ("jails/linux/src/lib.rs", "&self.agent_binary"): {"copse-agent"},
    ("e2b-compat/agent/src/process/spawn.rs", "&plan.cmd"): set(),
    ("e2b-compat/agent/src/guest/apply.rs", "&cmd.argv[0]"): set(),
    ("jails/freebsd/src/exec.rs", "&cmd.program"): {"jexec", "zfs", "devfs", "mount", "umount", "rctl", "pw"},
    ("jails/freebsd/src/exec.rs", "&launch.program"): {"jexec"},
    ("cubenet/src/freebsd/system.rs", "program"): {"ifconfig", "route", "pfctl", "sysctl"},
    ("bhyve/src/exec.rs", "cmd.program"): {"bhyve", "bhyvectl", "zfs", "ifconfig", "sysctl", "dd"},
    ("rigs/tests/bhyve_refuses.rs", 'env!("CARGO_BIN_EXE_copse-rig-bhyve"'): set(),
    ("e2b-compat/gateway/tests/template_backend.rs", 'env!("CARGO_BIN_EXE_copse"'): {"copse"},
    ("rigs/src/gateway.rs", "&bins.copse"): {"copse"},
    ("rigs/src/bin/lifecycle.rs", "&bins.copse"): {"copse"},
    ("rigs/src/bin/lifecycle.rs", "&args.weed"): {"weed"},
    ("rigs/src/seaweedfs.rs", "weed"): {"weed"},
    ("rigs/src/bin/cluster.rs", "&bins.copse"): {"copse"},
    ("rigs/src/postgres.rs", 'program("initdb"'): {"initdb"},
    ("rigs/src/postgres.rs", 'program("postgres"'): {"postgres"},
    ("rigs/src/gateway.rs", "&self.copse"): {"copse"},
    ("rigs/src/bin/template.rs", "self.copse"): {"copse"},
    ("rigs/src/report.rs", "python"): {"python3"},
    ("rigs/src/anchors.rs", "b"): {"podman", "runc"},
    ("rigs/src/anchors.rs", "&argv[0]"): {"podman", "runc", "unshare"},
    ("rigs/src/bin/load.rs", "hey"): {"hey"},
    ("rigs/src/bin/load.rs", "p"): {"hey"},
    ("rigs/src/net.rs", "argv[0]"): {"ip"},
    ("e2b-compat/gateway/src/store/test_postgres.rs", "&bin"): {"initdb", "postgres"},
    # The gateway's own binary, as `copse lazy-image`.
    ("e2b-compat/gateway/src/lazy_layers.rs", "std::env::current_exe("): {"copse"},
}
# Started through another program (`ip netns exec … python3`, `nsenter …
# iperf3`), so no call site names them first.
NESTED = {"python3", "iperf3", "dnsmasq"}


def listed() -> dict:
    programs = {}
    for line in LIST.read_text().splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        program, source, scope = fields[:3]
        assert program not in programs, f"{program} is listed twice"
        programs[program] = (source, scope)
    return programs


def sources(pattern: str):
    for path in sorted(ROOT.glob(pattern)):
        rel = path.relative_to(ROOT).as_posix()
        # This file's own examples of calls are not calls.
        if not rel.startswith(("target/", ".venv/")) and path != pathlib.Path(__file__).resolve():
            yield rel, path.read_text()


def started_programs():
    """(program, where) for every literal program and every computed site."""
    found, computed = [], []
    for rel, text in sources("**/*.rs"):
        found += [(os.path.basename(p), rel) for p in RUST_LITERAL.findall(text)]
        computed += [(rel, expr.strip()) for expr in RUST_COMPUTED.findall(text)]
    for rel, text in sources("**/*.py"):
        found += [(os.path.basename(p), rel) for p in PY_LITERAL.findall(text)]
    return found, computed


def test_every_program_the_code_starts_is_listed():
    programs = listed()
    found, computed = started_programs()
    assert found, "the scan found no program at all: the patterns are broken"
    unlisted = sorted({f"{program} (started in {where})" for program, where in found if program not in programs})
    assert not unlisted, f"add these to scripts/host-programs: {unlisted}"
    unknown = sorted({site for site in computed if site not in COMPUTED_SITES})
    assert not unknown, f"new call sites with a computed program; name what they start in COMPUTED_SITES: {unknown}"
    named = set().union(*COMPUTED_SITES.values()) | NESTED
    assert not named - programs.keys(), f"add these to scripts/host-programs: {sorted(named - programs.keys())}"


def test_the_scan_sees_a_new_program():
    """The guard itself: a call the list does not name is found."""
    assert RUST_LITERAL.findall('let out = Command::new("iptables-restore").arg("-w");') == ["iptables-restore"]
    assert PY_LITERAL.findall('subprocess.run(["iptables", "-L"])') == ["iptables"]
    assert RUST_COMPUTED.findall("Command::new(&tool).spawn()") == ["&tool"]


def test_bootstrap_installs_exactly_the_listed_packages():
    for scopes in (["serve"], ["serve", "test"], ["bench"]):
        wanted = sorted({s[4:] for s, scope in listed().values() if s.startswith("deb:") and scope in scopes})
        printed = subprocess.run(
            [str(ROOT / "scripts" / "bootstrap"), "--packages", *scopes], capture_output=True, text=True, check=True
        ).stdout.split()
        assert printed == wanted, scopes


def owning_package(path: str) -> str | None:
    real = os.path.realpath(path)
    # The name itself first: a symlink's package is the one that ships the
    # command (musl-tools' musl-gcc points at musl-dev's compiler wrapper).
    # Then merged /usr: dpkg may know the file under either name.
    candidates = (path, path.removeprefix("/usr"), "/usr" + path, real, real.removeprefix("/usr"), "/usr" + real)
    for candidate in dict.fromkeys(candidates):
        out = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
        # A diverted file (dash's /bin/sh) is listed after its diversions.
        owners = [line for line in out.stdout.splitlines() if not line.startswith("diversion by ")]
        if out.returncode == 0 and owners:
            return owners[0].split(":")[0].strip()
    return None


def is_base_package(package: str) -> bool:
    fields = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Essential} ${Priority}", package], capture_output=True, text=True
    ).stdout.split()
    return "yes" in fields or "required" in fields


HOST_SCOPES = ("serve", "test")


@pytest.mark.parametrize(
    "program", sorted(p for p, (source, scope) in listed().items() if scope in HOST_SCOPES and source != "cargo")
)
def test_each_program_for_serving_and_testing_is_installed(program):
    source, _ = listed()[program]
    path = shutil.which(program) or (program == "criu" and shutil.which("/usr/local/sbin/criu"))
    if source == "deb:postgresql" and not path:
        # Debian keeps the server's programs off the PATH, by major version.
        path = next(iter(sorted(pathlib.Path("/usr/lib/postgresql").glob(f"*/bin/{program}"), reverse=True)), None)
        path = path and str(path)
    assert path, f"{program} ({source}) is not installed: scripts/bootstrap must provide it"
    if source.startswith("deb:"):
        owner = owning_package(path)
        # `postgresql` is Debian's metapackage for the current major
        # version's `postgresql-N`, which owns the files.
        assert owner == source[4:] or (source == "deb:postgresql" and (owner or "").startswith("postgresql-")), (
            f"{path} does not come from {source}"
        )
    elif source == "base":
        package = owning_package(path)
        assert package and is_base_package(package), (
            f"{path} comes from {package}, which a fresh Debian does not have: list it as deb:{package}"
        )
    elif source == "criu":
        assert subprocess.run([path, "check"], capture_output=True).returncode == 0, "`criu check` fails"
    elif source == "seaweedfs":
        assert subprocess.run([path, "version"], capture_output=True).returncode == 0, "`weed version` fails"
