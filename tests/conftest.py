"""Starts a real copse gateway for the suite and points the official E2B SDK
at it, exactly as a user would (three environment variables)."""

import base64
import hashlib
import itertools
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
COPSE = ROOT / "target" / "release" / "copse"
API_KEY = "copse-test-key-0123456789abcdef"
# Templates are cached here between runs; sandboxes never outlive a run.
DATA_DIR = pathlib.Path(os.environ.get("COPSE_TEST_DATA_DIR", "/var/lib/copse-test"))
# The suite's own sandbox network, apart from a gateway serving on this host
# (copse0, 10.88.0.0/16). Exported so every gateway the suite starts, and
# the leak checks, use it.
os.environ.setdefault("COPSE_BRIDGE", "copset")
os.environ.setdefault("COPSE_SUBNET", "10.89.0.0/16")
BRIDGE = os.environ["COPSE_BRIDGE"]
SUBNET = os.environ["COPSE_SUBNET"]
# Every sandbox's disk quota (`copse up --disk-mb`): small, so filling it
# in the hostile suite is quick and bounded.
os.environ.setdefault("COPSE_DISK_MB", "256")
DISK_MB = int(os.environ["COPSE_DISK_MB"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wheel(directory, module: str, value: str):
    """A pure-Python wheel of `module`, whose `VALUE` is `value`."""
    dist = f"{module}-1.0.dist-info"
    files = {
        f"{module}/__init__.py": f"VALUE = {value!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: copse-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record += f"{path},sha256={digest},{len(text.encode())}\n"
    files[f"{dist}/RECORD"] = record + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(directory / f"{module}-1.0-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


def first_metrics(sbx, within: float = 10.0, after: float = 0.0):
    """The sandbox's metrics once the gateway has sampled it at least once
    at or after `after` (Unix seconds): a read within a second of a sample
    returns that sample, which may predate what the caller just did."""
    deadline = time.monotonic() + within

    def fresh(metrics):
        return metrics and metrics[-1].timestamp.timestamp() >= after

    while not fresh(metrics := sbx.get_metrics()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert fresh(metrics), f"no metrics taken after {after} within {within:.0f} s"
    return metrics


def create_refused(gateway, network: dict, field: str, nonce: str):
    """A create whose `network` (wire names) is bad is a 400 with E2B's
    `{code, message}` naming `field`; `nonce` tags it for `none_created`."""
    import httpx

    body = {"templateID": "base", "metadata": {"probe": nonce}, "network": network}
    headers = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    response = httpx.post(gateway.url + "/sandboxes", json=body, headers=headers, timeout=30)
    assert response.status_code == 400, (network, response.text)
    assert response.json()["code"] == 400 and field in response.json()["message"], response.text


def none_created(gateway, nonce: str):
    """No sandbox tagged `nonce` exists: the refused creates made nothing."""
    import httpx

    headers = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    listed = httpx.get(gateway.url + "/v2/sandboxes", params={"metadata": f"probe={nonce}"}, headers=headers)
    assert listed.status_code == 200 and listed.json() == [], listed.text


_netns_hosts = itertools.count()


def netns_host_names(tag: str) -> tuple[str, str]:
    """A new (namespace, host-side veth) name pair for a netns test host on
    every call, so that a module's host never needs the names of one the
    previous module is still tearing down."""
    n, pid = next(_netns_hosts), os.getpid()
    return f"cn-{tag}-{pid}-{n}", f"cn{tag[:2]}{pid % 100000}{n}"


def remove_netns_host(ns: str, veth: str):
    """Deleting a namespace frees its veth asynchronously in the kernel; the
    host end is deleted first, which removes the pair before returning, so no
    stale link keeps the host's address or route."""
    for argv in (("ip", "link", "del", veth), ("ip", "netns", "del", ns)):
        subprocess.run(argv, capture_output=True)


def unmount_lazy_layers(data_dir: pathlib.Path):
    """Lazily fetched layers an earlier run left mounted (its gateway was
    killed): their images and their servers' files, which ends the
    servers. A gateway's own stop unmounts those no sandbox uses."""
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts if line.split()[2] in ("erofs", "fuse")]
    for point in sorted((p for p in points if p.startswith(f"{data_dir}/")), reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def second_data_dir(name: str) -> pathlib.Path:
    """A data dir for a second gateway: fresh but for its templates (hard
    links to the suite's, kept between runs) and its sandboxes' disk (kept
    mounted; the gateway clears it at start), so an earlier run's rows and
    layers never meet this one's."""
    data_dir = DATA_DIR / name
    data_dir.mkdir(exist_ok=True)
    unmount_lazy_layers(data_dir)
    for entry in data_dir.iterdir():
        if entry.name not in ("templates", "disk", "disk.img"):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    share_templates(data_dir)
    return data_dir


def share_templates(data_dir: pathlib.Path):
    """Gives a second gateway's data dir the suite's built templates, as
    hard links; a template rebuilt since (its template.json differs) is
    linked again, so the second gateway never starts a build of its own."""
    source, target = DATA_DIR / "templates", data_dir / "templates"
    target.mkdir(parents=True, exist_ok=True)
    for leftover in target.glob(".*"):  # builds the second gateway began
        shutil.rmtree(leftover, ignore_errors=True)
    for built in source.iterdir():
        if built.name.startswith(".") or not (built / "template.json").exists():
            continue  # a build in progress, or an outdated root moved aside
        linked = target / built.name
        if (linked / "template.json").exists() and (linked / "template.json").read_bytes() == (
            built / "template.json"
        ).read_bytes():
            continue
        shutil.rmtree(linked, ignore_errors=True)
        subprocess.run(["cp", "-al", str(built), str(linked)], check=True)


class Gateway:
    def __init__(self, data_dir: pathlib.Path, host: str = "127.0.0.1", port: int = 0):
        self.data_dir = data_dir
        self.host = host
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        # Where it is ready once something listens: the API, unless it
        # serves none (a worker node's peer listener).
        self.ready_port = self.port
        self.proc = None
        self.log = open(data_dir / "gateway.log", "ab")

    def start(self, keep_sandboxes: bool = False, pools: str = "base=0", extra_args=(), env=None):
        # No warm pool by default: the leak checks account for every sandbox
        # on the host, and pooled ones belong to no user.
        args = [str(COPSE), "up", "--listen", f"{self.host}:{self.port}", "--data-dir", str(self.data_dir), "--pool", pools]
        if keep_sandboxes:
            args.append("--keep-sandboxes")
        args.extend(extra_args)
        env = dict(env or os.environ, COPSE_API_KEY=API_KEY, COPSE_LOG=os.environ.get("COPSE_LOG", "info"))
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"copse up exited with {self.proc.returncode}; see {self.data_dir}/gateway.log")
            try:
                with socket.create_connection((self.host, self.ready_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("copse up did not start listening within 60 s")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            code = self.proc.wait(timeout=60)
            # -SIGTERM: the signal came before the gateway caught it, so
            # nothing it had booted was drained.
            assert code == 0, f"copse up ended with {code} on SIGTERM; see {self.data_dir}/gateway.log"

    def crash(self):
        """kill -9: no cleanup runs; the next start must recover."""
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def gateway():
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    # Visible progress the first time: building a template takes a minute.
    subprocess.run([str(COPSE), "template", "build", "--data-dir", str(DATA_DIR)], check=True)
    gw = Gateway(DATA_DIR)
    gw.start()
    os.environ.update(
        E2B_API_URL=gw.url,
        E2B_SANDBOX_URL=gw.url,
        E2B_API_KEY=API_KEY,
        E2B_CONNECTION_RETRIES="0",
    )
    os.environ.pop("E2B_DEBUG", None)
    yield gw
    gw.stop()
    # A gateway keeps its bridge and nftables table across restarts; the
    # suite's own network goes with the suite.
    subprocess.run(["nft", "delete", "table", "inet", f"copse_{BRIDGE}"], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


@pytest.fixture
def sandbox(gateway):
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120)
    yield sbx
    sbx.kill()


def pytest_collection_modifyitems(items):
    """Every test is bounded (the first one's setup may build a template, so
    only the test body counts); heavier tests set their own, longer limit."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(180, func_only=True))
