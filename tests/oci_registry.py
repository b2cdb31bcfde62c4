"""A real OCI registry on loopback for the image tests (Debian's
`docker-registry`, the CNCF distribution registry), and images built here
as OCI layouts, layer by layer, then pushed with `skopeo`.

Layers are written with Python's tarfile, so a test can put in them what no
well-behaved tool would (`..`, absolute names, links out of the root)."""

import gzip
import hashlib
import io
import json
import pathlib
import re
import shutil
import socket
import subprocess
import tarfile
import time

from conftest import COPSE, DATA_DIR, free_port


class Registry:
    def __init__(self, workdir: pathlib.Path, login: tuple = None):
        """`login`: (username, password) the registry requires (htpasswd)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.log_path = workdir / "registry.log"
        config = workdir / "registry.yml"
        auth = ""
        if login:
            htpasswd = workdir / "htpasswd"
            htpasswd.write_text(f"{login[0]}:{bcrypt(login[1])}\n")
            auth = f"auth:\n  htpasswd:\n    realm: copse-test\n    path: {htpasswd}\n"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: info\n"
            f"storage:\n  filesystem:\n    rootdirectory: {workdir / 'storage'}\n"
            f"http:\n  addr: {self.host}\n" + auth
        )
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the registry did not start listening")

    def requests(self) -> int:
        """Requests to the registry API the registry has logged at all."""
        return len(re.findall(r'"(?:GET|HEAD) /v2/', self.log_path.read_text(errors="replace")))

    def blob_gets(self, repository: str) -> int:
        """Blob downloads the registry has served for `repository`."""
        text = self.log_path.read_text(errors="replace")
        return len(re.findall(rf'"GET /v2/{re.escape(repository)}/blobs/sha256:[0-9a-f]+[^"]* HTTP/1\.1" 200', text))

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.log.close()


def bcrypt(password: str) -> str:
    """A bcrypt hash as htpasswd files hold, from the C library's crypt
    (libxcrypt): no htpasswd tool or Python package needed."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

        return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))


def member(name: str, data: bytes = b"", kind=tarfile.REGTYPE, link: str = "", mode: int = 0o644):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.size = kind, link, mode, len(data)
    if kind == tarfile.DIRTYPE:
        info.mode = 0o755
    return info, (io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def layer(members) -> bytes:
    """An uncompressed layer tar from (TarInfo, file) pairs."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, data)
    return out.getvalue()


def tree_members(root: pathlib.Path):
    """A directory's files as layer members, paths relative to it."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out.append(member(rel, kind=tarfile.SYMTYPE, link=str(path.readlink()), mode=0o777))
        elif path.is_dir():
            out.append(member(rel, kind=tarfile.DIRTYPE))
        else:
            out.append(member(rel, path.read_bytes(), mode=path.stat().st_mode & 0o7777))
    return out


def tiny_root(root: pathlib.Path, marker: str):
    """bash and the libraries it loads (ldd), a root account and a marker:
    enough for the SDK's `/bin/bash -l -c` and bash's builtins."""
    ldd = subprocess.run(["ldd", "/bin/bash"], capture_output=True, text=True, check=True).stdout
    for lib in re.findall(r"(/\S+) \(0x", ldd):
        dest = root / lib.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pathlib.Path(lib).resolve(), dest)
    (root / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2("/bin/bash", root / "bin" / "bash")
    (root / "bin" / "sh").symlink_to("bash")
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    (root / "etc" / "image-marker").write_text(marker + "\n")


def oci_layout(directory: pathlib.Path, tag: str, layers: list, env=(), workdir="/", user=None, cmd=None) -> str:
    """Writes an OCI image layout holding one image of `layers` (tars),
    gzip-compressed as registries serve them; returns its manifest digest."""
    blobs = directory / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def blob(data: bytes, media_type: str) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": list(env), "WorkingDir": workdir, **({"User": user} if user else {}),
                   **({"Cmd": cmd} if cmd else {})},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(t).hexdigest()}" for t in layers]},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"),
        "layers": [
            blob(gzip.compress(t, mtime=0), "application/vnd.oci.image.layer.v1.tar+gzip") for t in layers
        ],
    }
    entry = blob(json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
    entry["annotations"] = {"org.opencontainers.image.ref.name": tag}
    (directory / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (directory / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
    return entry["digest"]


def push(layout: pathlib.Path, tag: str, registry: Registry, repository: str, login: tuple = None):
    creds = [f"--dest-creds={login[0]}:{login[1]}"] if login else []
    subprocess.run(
        [
            "skopeo",
            "copy",
            "--insecure-policy",
            "--dest-tls-verify=false",
            *creds,
            f"oci:{layout}:{tag}",
            f"docker://{registry.host}/{repository}:{tag}",
        ],
        check=True,
        capture_output=True,
    )


def copse_pull(reference: str, name: str, registry: Registry, timeout: float = 120):
    """`copse image pull` through a docker.io mirror at the test registry."""
    return subprocess.run(
        [
            str(COPSE),
            "image",
            "pull",
            reference,
            "--name",
            name,
            "--registry-mirror",
            f"docker.io=http://{registry.host}",
            "--data-dir",
            str(DATA_DIR),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def remove_template(name: str):
    templates = DATA_DIR / "templates"
    for path in (templates / name, templates / f".{name}.replaced", templates / f".{name}.building"):
        shutil.rmtree(path, ignore_errors=True)
