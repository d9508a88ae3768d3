"""The dev cluster's container images (``dynatrain/devcluster/images.py``), built for real.

The archives are read back as an importer reads them (index.json -> manifest -> config and
layers, every blob checked against its digest). Importing and running them is
test_real_node.py's part: the real node's containerd imports both, runs its pod sandboxes in
the pause image and the operator's workers in the worker image. Last, a code change must
rebuild only the project's layer.

Needs root (debootstrap, chroot, mount, containerd) and Debian's ``containerd``, ``runc`` and
``debootstrap`` (``tools/install-debs.sh containerd runc debootstrap``): without them these
tests skip, saying why, and fail under CI. The first build takes about 2 minutes and network
(the Debian mirror, PyPI); later ones come from ``~/.cache/dynatrain/images``. The import
into a node's containerd writes about 12 GB, removed when the node stops.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from dynatrain.devcluster import images

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("containerd", "ctr", "runc", "debootstrap", "unshare", "chroot", "mount",
            "dpkg-deb", "apt-get")
INSTALL_HINT = "tools/install-debs.sh containerd runc debootstrap"


def _unavailable(reason: str):
    # As in conftest.py: in CI a missing prerequisite is a failure, elsewhere a skip.
    if os.environ.get("CI"):
        pytest.fail(f"image tests cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def prerequisites():
    if os.geteuid() != 0:
        _unavailable("building and running images needs root (debootstrap, chroot, mount, "
                     "containerd)")
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        _unavailable(f"missing {', '.join(missing)}: {INSTALL_HINT}")


@pytest.fixture(scope="module")
def pause(prerequisites) -> images.Image:
    return images.pause_image()


@pytest.fixture(scope="module")
def worker(prerequisites) -> images.Image:
    return images.worker_image(REPO)


# ---- reading an archive back ------------------------------------------------------------


class _HashingReader:
    def __init__(self, f):
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def read(self, n=-1):
        data = self._f.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data


def _scan_layer(fileobj, wanted=()) -> tuple[str, int, dict[str, tarfile.TarInfo], dict]:
    """One pass over a layer blob: its digest and size, its entries, the ``wanted`` files."""
    reader = _HashingReader(fileobj)
    entries, contents = {}, {}
    with tarfile.open(fileobj=reader, mode="r|") as tf:
        for member in tf:
            entries[member.name] = member
            if member.name in wanted:
                contents[member.name] = tf.extractfile(member).read()
    while reader.read(1 << 20):  # the end-of-archive blocks belong to the blob too
        pass
    return "sha256:" + reader.sha.hexdigest(), reader.size, entries, contents


def _read_archive(image: images.Image) -> dict:
    """index.json -> manifest -> config, each blob checked against its descriptor."""
    tf = tarfile.open(image.archive)
    members = {m.name: m for m in tf.getmembers()}

    def blob(desc: dict) -> bytes:
        member = members[f"blobs/sha256/{desc['digest'].removeprefix('sha256:')}"]
        data = tf.extractfile(member).read()
        assert len(data) == desc["size"] == member.size
        assert "sha256:" + hashlib.sha256(data).hexdigest() == desc["digest"]
        return data

    assert json.loads(tf.extractfile("oci-layout").read()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(tf.extractfile("index.json").read())
    (desc,) = index["manifests"]
    assert desc["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert desc["annotations"]["org.opencontainers.image.ref.name"] == image.ref
    assert desc["annotations"]["io.containerd.image.name"] == image.ref
    assert desc["digest"] == image.manifest_digest
    manifest = json.loads(blob(desc))
    config = json.loads(blob(manifest["config"]))
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert config["os"] == "linux" and config["architecture"] == desc["platform"]["architecture"]
    blob_names = {n for n in members if n.startswith("blobs/sha256/")}
    expected = {f"blobs/sha256/{d['digest'].removeprefix('sha256:')}"
                for d in (desc, manifest["config"], *manifest["layers"])}
    assert blob_names == expected, "every blob is referenced, every reference has a blob"
    return {"tar": tf, "members": members, "manifest": manifest, "config": config}


def _layers(archive: dict, wanted=()) -> list[tuple[str, int, dict, dict]]:
    """Each layer scanned, checked against its descriptor and the config's diff_id."""
    out = []
    diff_ids = archive["config"]["rootfs"]["diff_ids"]
    assert archive["config"]["rootfs"]["type"] == "layers"
    assert len(diff_ids) == len(archive["manifest"]["layers"])
    for desc, diff_id in zip(archive["manifest"]["layers"], diff_ids):
        # Uncompressed, so the blob's digest is its diff_id.
        assert desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
        member = archive["members"][f"blobs/sha256/{desc['digest'].removeprefix('sha256:')}"]
        digest, size, entries, contents = _scan_layer(archive["tar"].extractfile(member), wanted)
        assert (digest, size) == (desc["digest"], desc["size"]) and digest == diff_id
        out.append((digest, size, entries, contents))
    return out


# ---- the archives -----------------------------------------------------------------------


def test_pause_archive(pause):
    archive = _read_archive(pause)
    cfg = archive["config"]["config"]
    assert cfg["Entrypoint"][:2] == ["/bin/sh", "-c"]
    assert "trap 'exit 0' TERM" in cfg["Entrypoint"][2]
    assert cfg["User"] == "65535:65535"
    ((_, size, entries, _),) = _layers(archive)
    assert entries["bin/busybox"].isfile() and entries["bin/busybox"].mode & 0o111
    assert entries["bin/sh"].linkname == "busybox" and entries["bin/sleep"].linkname == "busybox"
    assert size < 4 << 20


def test_worker_archive(worker):
    archive = _read_archive(worker)
    cfg = archive["config"]["config"]
    assert cfg["Entrypoint"] == ["dynatrain"] and cfg["Cmd"] == ["--help"]
    assert cfg["User"] == "10001" and cfg["WorkingDir"] == "/home/dynatrain"
    assert cfg["Env"] == [
        "PATH=/opt/dynatrain/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1"]
    assert set(cfg["ExposedPorts"]) == {"8080/tcp", "9090/tcp", "50051/tcp"}
    site = "opt/dynatrain/lib/python3.11/site-packages"
    base, project = _layers(archive, wanted={"etc/passwd", "opt/dynatrain/bin/dynatrain"})

    # Layer 1: Debian, the user and the venv with the dependencies; no caches, no device nodes.
    _, base_size, entries, contents = base
    assert b"\ndynatrain:x:10001:10001:" in contents["etc/passwd"]
    assert entries["home/dynatrain"].isdir() and entries["home/dynatrain"].uid == 10001
    for path in ("usr/bin/python3.11", "opt/dynatrain/bin/python", f"{site}/torch/__init__.py",
                 f"{site}/grpc/__init__.py", f"{site}/kopf/__init__.py"):
        assert path in entries, path
    assert not [n for n in entries if n.startswith(("dev/", "proc/", "sys/", "root/.cache",
                                                    "var/lib/apt/lists/", "tmp/"))
                and not entries[n].isdir()]
    assert not [n for n in entries if n.endswith(".deb") or n.startswith(f"{site}/dynatrain")]
    assert "etc/resolv.conf" not in entries
    assert base_size > 1 << 30

    # Layer 2: only what installing the wheel adds, under the venv.
    _, project_size, entries, contents = project
    assert all(n == "opt" or n.startswith("opt/dynatrain") for n in entries), sorted(entries)[:20]
    assert not [n for n in entries if "/.wh." in n or n.startswith(".wh.")]
    assert f"{site}/dynatrain/__init__.py" in entries
    assert f"{site}/dynatrain/agent/worker.py" in entries
    assert any(n.startswith(f"{site}/dynatrain-") and n.endswith(".dist-info") for n in entries)
    assert contents["opt/dynatrain/bin/dynatrain"].startswith(b"#!/opt/dynatrain/bin/python\n")
    assert project_size < 64 << 20


def test_operator_archive_is_the_slim_one(prerequisites):
    """The Dockerfile's `operator` target as the dev cluster builds it: the operator's own
    requirements and the wheel without its dependencies; no torch, no numpy."""
    image = images.operator_image(REPO)
    assert image.ref == "localhost/dynatrain-operator:dev"
    archive = _read_archive(image)
    cfg = archive["config"]["config"]
    assert cfg["Entrypoint"] == ["dynatrain"] and cfg["Cmd"] == ["operator", "--help"]
    assert cfg["User"] == "10001" and set(cfg["ExposedPorts"]) == {"8080/tcp", "9090/tcp"}
    site = "opt/dynatrain/lib/python3.11/site-packages"
    (_, base_size, base, _), (_, _, project, _) = _layers(archive)
    for path in (f"{site}/kopf/__init__.py", f"{site}/kubernetes/__init__.py",
                 f"{site}/grpc/__init__.py", f"{site}/prometheus_client/__init__.py"):
        assert path in base, path
    heavy = [n for n in base if n.startswith((f"{site}/torch/", f"{site}/numpy/"))]
    assert not heavy, heavy[:5]
    assert base_size < 1 << 30                     # the worker's is over 5 GiB
    assert f"{site}/dynatrain/operator/handlers.py" in project
    # The worker's layer 1 is not shared with it: each has its own cache entry.
    assert images.worker_image(REPO).layers[0].digest != archive["manifest"]["layers"][0][
        "digest"]


def test_overlay_whiteouts_become_oci_whiteouts(prerequisites, tmp_path):
    """An overlayfs upper directory's whiteout and opaque directory, as OCI writes them."""
    upper = tmp_path / "upper"
    (upper / "etc" / "opaque").mkdir(parents=True)
    (upper / "etc" / "opaque" / "kept").write_text("x")
    os.setxattr(upper / "etc" / "opaque", "trusted.overlay.opaque", b"y")
    os.mknod(upper / "etc" / "gone", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    with open(tmp_path / "layer.tar", "wb") as f:
        images.tar_tree(upper, f, overlay_upper=True)
    with tarfile.open(tmp_path / "layer.tar") as tf:
        names = tf.getnames()
    assert names == ["etc", "etc/.wh.gone", "etc/opaque", "etc/opaque/.wh..wh..opq",
                     "etc/opaque/kept"]


# ---- rebuilds (last: a rebuild replaces the archive the tests above read) -----------------


def test_code_change_rebuilds_only_the_project_layer(worker, tmp_path):
    copy = tmp_path / "repo"
    copy.mkdir()
    for name in ("Dockerfile", "pyproject.toml", "README.md", "dynatrain", "vps", "agent",
                 "operator"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(REPO / name, copy / name)
    with open(copy / "dynatrain" / "devcluster" / "errors.py", "a") as f:
        f.write(f"\n# {uuid.uuid4()}\n")
    try:
        started = time.monotonic()
        changed = images.worker_image(copy)
        elapsed = time.monotonic() - started
        assert changed.archive != worker.archive
        assert changed.layers[0] == worker.layers[0], "the dependency layer is reused"
        assert changed.layers[1] != worker.layers[1]
        print(f"a code change rebuilt the worker image in {elapsed:.1f} s")
        archive = _read_archive(changed)
        desc = archive["manifest"]["layers"][1]
        member = archive["members"][f"blobs/sha256/{desc['digest'].removeprefix('sha256:')}"]
        errors_py = "opt/dynatrain/lib/python3.11/site-packages/dynatrain/devcluster/errors.py"
        digest, _, _, contents = _scan_layer(archive["tar"].extractfile(member), {errors_py})
        assert digest == desc["digest"]
        assert contents[errors_py] == (copy / "dynatrain" / "devcluster" / "errors.py").read_bytes()
    finally:
        images.worker_image(REPO)  # the checkout's image back in the cache
