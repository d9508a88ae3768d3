"""The dev cluster's container images, built on this machine with Debian's own tools.

The dev cluster's real node (:mod:`.kubelet`: a kubelet with containerd and runc) runs pods
from images, and no container registry is reachable where DynaTrain is developed and tested,
nor is Docker there to build with. So the two images its pods need are built here, as OCI
image-layout archives (``oci-layout``, ``index.json``, ``blobs/sha256/...`` in one tar) that
``ctr images import`` loads into the node's containerd (:func:`import_images`):

- ``localhost/dynatrain-pause:dev`` (:func:`pause_image`), containerd's ``sandbox_image``:
  Debian's statically linked busybox (package ``busybox-static``) running a shell that sleeps
  until SIGTERM or SIGINT, then exits 0;
- ``localhost/dynatrain:dev`` (:func:`worker_image`), the project's image for the operator and
  the workers, made as the repository's ``Dockerfile`` makes it but with Debian's tools instead
  of Docker: a root file system from ``debootstrap --variant=minbase`` with Debian's python3,
  a venv at ``/opt/dynatrain`` holding the dependencies from PyPI, the project's wheel
  installed into it, user ``dynatrain`` (UID 10001) and the Dockerfile's entry point,
  environment, user and working directory.

**Layers.** The worker image has two uncompressed layers (gzip of 5.7 GB would cost minutes on
every build and every import, and the archive never leaves this machine):

1. *dependencies* (5.7 GiB): Debian, the venv and torch & co., keyed by the Debian suite and
   packages, ``pyproject.toml``'s dependency list, the Python and pip versions;
2. *project* (~2 MiB): only what installing the project's wheel adds (its package, dist-info
   and the ``dynatrain`` script), keyed by the Dockerfile's build context as well.

Layer 2 is made by installing the wheel into an overlay mount whose lower directory is layer
1's root file system: the overlay's upper directory then holds exactly the files the install
created or changed (whiteouts, which this install does not make, would become OCI ``.wh.``
entries), and the cached root file system is never modified. A code change therefore rebuilds
layer 2 only, in seconds: layer 1 is the first blob of every worker archive, so the new archive
is the previous one cut right after that blob, with layer 2, config, manifest and index
appended (:class:`_Archive`); its 5.7 GB are neither copied nor re-read, and its digest comes
from the cache (``base-<key>/layer.json``).

**Cache.** ``~/.cache/dynatrain/images/`` (``$XDG_CACHE_HOME``; ``DYNATRAIN_IMAGES_CACHE``
overrides it), entries named by a hash of their inputs: ``pause-<key>.tar``, ``base-<key>/``
(layer 1's ``rootfs/``, its ``inputs.json`` and ``layer.json``) and ``worker-<key>.tar``, each
made under a temporary name and renamed when complete, under a file lock that serialises
concurrent builders (the second waits, then reuses the first one's result). A new entry
replaces the older ones of its kind, so the worker takes ~12 GB (root file system and
archive). :func:`import_images` holds an archive's lock shared while ``ctr`` reads it, so a
rebuild cannot cut an archive that is being imported.

**Build.** Building the worker image needs root (``debootstrap``, ``chroot``, ``mount``) and
network (the Debian mirror named in ``/etc/apt/sources.list.d/debian.sources``, PyPI). Each
command runs in its own mount namespace (``unshare --mount``), so the ``/proc``, ``/dev``,
pip-cache and overlay mounts it makes vanish when it exits, whatever happens. pip inside the
root file system uses the host's pip cache (bind-mounted) and CA bundle. Each step prints one
progress line; a failing step raises :class:`ImageBuildError` naming the command, its exit
code, the tail of its output and the build log (``<cache>/<kind>-<key>.log``).

By hand: ``python -m dynatrain.devcluster.images [--repo DIR] [pause] [worker]``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import platform
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .errors import DevClusterError
from .gobuild import cache_root
from .processes import _die_with_parent, check_output

PAUSE_REF = "localhost/dynatrain-pause:dev"
WORKER_REF = "localhost/dynatrain:dev"

SUITE = "bookworm"
"""The Debian release of the worker image (the host's own release in this project's sandboxes)."""
PYTHON_VERSION = "3.11"
"""The suite's python3, as in the Dockerfile's ``python:3.11-slim``; checked after debootstrap."""
DEBIAN_PACKAGES = ("python3", "python3-venv", "ca-certificates")
"""Installed by debootstrap on top of minbase (Depends only, no Recommends). python3-venv brings
ensurepip's pip; ca-certificates is what a pip in the image would verify PyPI with."""
PIP_VERSION = "26.3"
"""The venv's pip is upgraded to this from Debian's 23.0 (early 2023): the pip the project's
.venv was made with, so that the image resolves as the host does and both use one pip cache
format (the host's cache is bind-mounted into the build)."""
USER_UID = 10001
VENV = "/opt/dynatrain"
USER_HOME = "/home/dynatrain"
DEFAULT_MIRROR = "http://deb.debian.org/debian"

WORKER_CONFIG = {
    # The Dockerfile's USER, ENV, WORKDIR, EXPOSE, ENTRYPOINT and CMD; PATH puts the venv first
    # (the Dockerfile's python image has its Python in /usr/local/bin).
    "User": str(USER_UID),
    "Env": [f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1"],
    "Entrypoint": ["dynatrain"],
    "Cmd": ["--help"],
    "WorkingDir": USER_HOME,
    "ExposedPorts": {"8080/tcp": {}, "9090/tcp": {}, "50051/tcp": {}},
}

# pid 1 of a PID namespace gets no default signal actions: without handlers SIGTERM would be
# ignored and every sandbox stop would wait for SIGKILL. `wait` returns as soon as a trapped
# signal arrives; the backgrounded sleep dies with the namespace when pid 1 exits. Like the
# pause it replaces (registry.k8s.io/pause), it runs as 65535:65535.
PAUSE_SCRIPT = "trap 'exit 0' TERM INT; while :; do sleep 86400 & wait; done"
PAUSE_CONFIG = {
    "User": "65535:65535",
    "Env": ["PATH=/bin"],
    "Entrypoint": ["/bin/sh", "-c", PAUSE_SCRIPT],
    "WorkingDir": "/",
}

# Bump when the way a root file system (_BASE_FORMAT) or an archive (_ARCHIVE_FORMAT, the
# pause image and the worker's layer 2) is made changes, so that the cached ones are rebuilt.
_BASE_FORMAT = 1
_ARCHIVE_FORMAT = 2
_SOURCE_DATE = 0
"""mtime of the files this module makes itself (the pause layer), so its digest is stable."""
_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_CONFIG = "application/vnd.oci.image.config.v1+json"
_PROGRESS = "[images]"


class ImageBuildError(DevClusterError):
    """An image could not be built or imported; the message names the command and its output."""


@dataclass(frozen=True)
class Layer:
    """One layer blob of an image."""

    digest: str
    """``sha256:...`` of the uncompressed tar: the blob's digest and the config's diff_id."""
    size: int


@dataclass(frozen=True)
class Image:
    """A built image: its name and the OCI archive to import."""

    ref: str
    archive: Path
    manifest_digest: str
    """What ``ctr images ls`` shows as the image's digest after the import."""
    layers: tuple[Layer, ...]

    @property
    def chain_id(self) -> str:
        """The snapshot key of the unpacked image (OCI image spec, "ChainID")."""
        chain = self.layers[0].digest
        for layer in self.layers[1:]:
            chain = "sha256:" + hashlib.sha256(f"{chain} {layer.digest}".encode()).hexdigest()
        return chain


Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def images_cache() -> Path:
    """``$DYNATRAIN_IMAGES_CACHE``, else ``$XDG_CACHE_HOME/dynatrain/images``."""
    return cache_root("images", "DYNATRAIN_IMAGES_CACHE")


# --------------------------------------------------------------------------------------------
# Public API


def pause_image(*, log: Log | None = None) -> Image:
    """The pod sandbox image (``localhost/dynatrain-pause:dev``), built first if not cached.

    Needs no root: ``apt-get download`` (or apt's own archive cache) and ``dpkg-deb -x``.
    """
    log = log or _stderr
    cache = images_cache()
    deb = _busybox_deb(cache, log)
    key = _hash({"format": _ARCHIVE_FORMAT, "deb": _file_sha256(deb), "config": PAUSE_CONFIG,
                 "arch": _go_arch()})
    archive = cache / f"pause-{key}.tar"
    if not archive.is_file():
        with _cache_lock(cache):
            if not archive.is_file():
                _Build("pause", cache / f"pause-{key}.log", log).pause(deb, archive)
    return _read_image(archive, PAUSE_REF)


def worker_image(repo_root: Path, *, mirror: str | None = None, log: Log | None = None) -> Image:
    """The project's image (``localhost/dynatrain:dev``) from the checkout at ``repo_root``.

    Cached: a rebuild after a code change makes only the project's layer (seconds), a change of
    the dependencies rebuilds both (minutes). Building needs root and network.
    """
    log = log or _stderr
    repo_root = Path(repo_root).resolve()
    cache = images_cache()
    base_inputs = _base_inputs(repo_root)
    base_key = _hash(base_inputs)
    context = _build_context(repo_root)
    key = _hash({"format": _ARCHIVE_FORMAT, "base": base_key,
                 "context": _tree_hash(repo_root, context), "config": WORKER_CONFIG})
    archive = cache / f"worker-{key}.tar"
    if not archive.is_file():
        with _cache_lock(cache):
            if not archive.is_file():
                build = _Build("worker", cache / f"worker-{key}.log", log)
                base = cache / f"base-{base_key}"
                if not (base / "inputs.json").is_file():
                    build.base(base_inputs, base, mirror or debian_mirror())
                build.worker(repo_root, context, base, archive)
    return _read_image(archive, WORKER_REF)


def import_images(ctr_socket: Path, images: Iterable[Image], *, namespace: str = "k8s.io",
                  snapshotter: str = "overlayfs", log: Log | None = None,
                  timeout: float = 1800) -> None:
    """Import ``images`` into the containerd at ``ctr_socket`` and unpack them for the CRI.

    ``ctr images import`` unpacks into ``snapshotter`` (the CRI's default, ``overlayfs``), so
    the CRI finds the image ready to run: unpacking the worker's 5.7 GB takes about 30 s here,
    and the import as a whole about 80 s (2 cores). The import is then checked: each image must
    be listed under its ref with the manifest's digest, and its unpacked snapshot (the layers'
    chain ID) must exist. An image already there with the same digest is not imported again.
    """
    log = log or _stderr
    base = ["ctr", "-a", str(ctr_socket), "-n", namespace]

    def listed() -> tuple[dict[str, str], str]:
        out = _check_output([*base, "images", "ls"], what="listing images", timeout=60)
        rows = [line.split() for line in out.splitlines()[1:]]
        return {row[0]: row[2] for row in rows if len(row) > 2}, out

    def unpacked(image: Image) -> bool:
        return subprocess.run([*base, "snapshots", "--snapshotter", snapshotter, "info",
                               image.chain_id], capture_output=True, timeout=60).returncode == 0

    for image in images:
        if listed()[0].get(image.ref) == image.manifest_digest and unpacked(image):
            log(f"{_PROGRESS} {image.ref} is already in {ctr_socket}")
            continue
        started = time.monotonic()
        log(f"{_PROGRESS} importing {image.ref} ({_size(image.archive.stat().st_size)}) into "
            f"{ctr_socket}")
        with _shared(image.archive):
            _check_output([*base, "images", "import", "--snapshotter", snapshotter,
                           str(image.archive)], what=f"importing {image.ref}", timeout=timeout)
        found, table = listed()
        if found.get(image.ref) != image.manifest_digest:
            raise ImageBuildError(
                f"`ctr images import {image.archive}` did not name the image {image.ref} with "
                f"digest {image.manifest_digest}; containerd lists:\n{table}")
        if not unpacked(image):
            raise ImageBuildError(
                f"`ctr images import {image.archive}` did not unpack {image.ref} into the "
                f"{snapshotter} snapshotter: no snapshot {image.chain_id}")
        log(f"{_PROGRESS} imported {image.ref} in {time.monotonic() - started:.1f} s")


@contextlib.contextmanager
def _shared(archive: Path) -> Iterator[None]:
    """Hold ``archive`` shared while it is read: a rebuild reusing it waits (exclusive lock)."""
    try:
        f = open(archive, "rb")
    except FileNotFoundError:
        raise ImageBuildError(f"{archive} is gone: a newer build replaced it; ask for the image "
                              "again") from None
    with f:
        fcntl.flock(f, fcntl.LOCK_SH)
        try:
            same = os.stat(archive).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise ImageBuildError(f"{archive} was replaced by a newer build while waiting for it;"
                                  " ask for the image again")
        yield


def debian_mirror(sources: Path = Path("/etc/apt/sources.list.d/debian.sources")) -> str:
    """The host's Debian mirror for :data:`SUITE` (deb822 sources), else deb.debian.org."""
    try:
        text = sources.read_text()
    except OSError:
        return DEFAULT_MIRROR
    for stanza in text.split("\n\n"):
        fields = {}
        for line in stanza.splitlines():
            if ":" in line and not line.startswith((" ", "\t", "#")):
                name, _, value = line.partition(":")
                fields[name.strip().lower()] = value.split()
        if SUITE in fields.get("suites", []) and fields.get("uris"):
            return fields["uris"][0].rstrip("/")
    return DEFAULT_MIRROR


# --------------------------------------------------------------------------------------------
# Inputs and keys


def _hash(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _go_arch() -> str:
    """The host's architecture as OCI (Go) names it; debootstrap builds for the host's."""
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le",
            "s390x": "s390x"}.get(machine, machine)


def _base_inputs(repo_root: Path) -> dict:
    """What decides layer 1's content (its cache key)."""
    pyproject = repo_root / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        raise ImageBuildError(f"cannot read [project] from {pyproject}: {exc}") from exc
    if "dependencies" in project.get("dynamic", []):
        raise ImageBuildError(f"{pyproject}: dynamic dependencies cannot key the image cache")
    return {"format": _BASE_FORMAT, "suite": SUITE, "packages": list(DEBIAN_PACKAGES),
            "python": PYTHON_VERSION, "pip": PIP_VERSION, "arch": _go_arch(),
            "uid": USER_UID, "venv": VENV,
            "dependencies": [d.strip() for d in project.get("dependencies", [])]}


def _build_context(repo_root: Path) -> list[str]:
    """The paths the Dockerfile's build stage copies in (``COPY pyproject.toml README.md ./``,
    ``COPY dynatrain/ dynatrain/``...): what the wheel is built from."""
    dockerfile = repo_root / "Dockerfile"
    try:
        lines = dockerfile.read_text().splitlines()
    except OSError as exc:
        raise ImageBuildError(f"cannot read {dockerfile}: {exc}") from exc
    paths: list[str] = []
    stages = 0
    for line in lines:
        words = line.split()
        if not words:
            continue
        if words[0].upper() == "FROM":
            stages += 1
            if stages > 1:
                break
        elif words[0].upper() == "COPY" and not any(w.startswith("--from") for w in words):
            paths += [w.rstrip("/") for w in words[1:-1] if not w.startswith("--")]
    missing = [p for p in paths if not (repo_root / p).exists()]
    if not paths or missing:
        raise ImageBuildError(f"{dockerfile}: its build stage copies {paths or 'nothing'}; "
                              f"missing in {repo_root}: {missing}")
    return paths


def _ignored(name: str) -> bool:
    # As .dockerignore: no bytecode or build metadata in the context.
    return name == "__pycache__" or name.endswith((".pyc", ".egg-info"))


def _context_files(repo_root: Path, context: Sequence[str]) -> Iterator[str]:
    for top in context:
        path = repo_root / top
        if path.is_file():
            yield top
            continue
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not _ignored(d))
            for name in sorted(filenames):
                if not _ignored(name):
                    yield os.path.relpath(os.path.join(dirpath, name), repo_root)


def _tree_hash(repo_root: Path, context: Sequence[str]) -> str:
    h = hashlib.sha256()
    for rel in _context_files(repo_root, context):
        h.update(rel.encode() + b"\0" + (repo_root / rel).read_bytes() + b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Cache


@contextlib.contextmanager
def _cache_lock(cache: Path) -> Iterator[None]:
    """One builder at a time per cache; the holder also clears what killed builders left."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for stale in cache.glob("*.tmp-*"):
            # A build killed before its rename. Its mounts were in a mount namespace that died
            # with it, so this is plain files (a root file system: device nodes, root-owned).
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        yield


def _prune(cache: Path, prefix: str, *keep: Path) -> None:
    """Remove the other ``prefix-*`` entries and their logs: a worker image is GBs, only the
    newest of each kind is kept (under the lock: no other builder is using them)."""
    for old in cache.glob(f"{prefix}-*"):
        if old in keep or ".tmp-" in old.name:
            continue
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _read_image(archive: Path, ref: str) -> Image:
    """The image's manifest digest and layers, read back from the archive's small members."""
    with tarfile.open(archive) as tf:
        def member(name: str) -> dict:
            f = tf.extractfile(name)
            assert f is not None
            return json.load(f)
        index = member("index.json")
        desc = index["manifests"][0]
        manifest = member("blobs/sha256/" + desc["digest"].removeprefix("sha256:"))
    layers = tuple(Layer(d["digest"], d["size"]) for d in manifest["layers"])
    return Image(ref=ref, archive=archive, manifest_digest=desc["digest"], layers=layers)


# --------------------------------------------------------------------------------------------
# Tar writing


class _HashingWriter:
    """A write-only file that hashes and counts the bytes passing through, so that a layer's
    digest comes in the same pass that writes it (5.7 GB are not read twice)."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._out.write(data)
        self._sha.update(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    @property
    def digest(self) -> str:
        return "sha256:" + self._sha.hexdigest()


def _walk(top: Path, rel: str = "") -> Iterator[tuple[str, str]]:
    """(path, name in the tar) of everything under ``top``, parents first, sorted by name."""
    with os.scandir(os.path.join(top, rel) if rel else top) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        name = f"{rel}/{entry.name}" if rel else entry.name
        yield entry.path, name
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(top, name)


def tar_tree(top: Path, out: BinaryIO, *, skip_contents: Sequence[str] = (),
             overlay_upper: bool = False) -> None:
    """Write the tree ``top`` to ``out`` as an uncompressed OCI layer.

    Deterministic for an unchanged tree: names sorted, owners numeric (the host's user names
    mean nothing in the image), mtimes in whole seconds (a fractional one costs a PAX header
    per file); hard links kept. ``skip_contents`` names directories kept empty (``dev``,
    ``proc``, ``sys``: the runtime mounts them). ``overlay_upper``: ``top`` is an overlayfs
    upper directory, whose whiteouts (0/0 character devices) and opaque directories become
    OCI's ``.wh.<name>`` and ``.wh..wh..opq`` entries.
    """
    skip = set(skip_contents)
    links: dict[tuple[int, int], str] = {}
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT,
                      copybufsize=1 << 20) as tf:
        for path, name in _walk(top):
            if name.rpartition("/")[0] in skip:
                continue
            st = os.lstat(path)
            info = tarfile.TarInfo(name)
            info.mode = stat.S_IMODE(st.st_mode)
            info.uid, info.gid = st.st_uid, st.st_gid
            info.uname = info.gname = ""
            info.mtime = int(st.st_mtime)
            mode = st.st_mode
            if stat.S_ISREG(mode):
                if st.st_nlink > 1 and (st.st_dev, st.st_ino) in links:
                    info.type, info.linkname = tarfile.LNKTYPE, links[st.st_dev, st.st_ino]
                    tf.addfile(info)
                    continue
                if st.st_nlink > 1:
                    links[st.st_dev, st.st_ino] = name
                info.size = st.st_size
                with open(path, "rb") as f:
                    tf.addfile(info, f)
            elif stat.S_ISDIR(mode):
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
                if overlay_upper and _xattr(path, "trusted.overlay.opaque") == b"y":
                    tf.addfile(_entry(f"{name}/.wh..wh..opq"))
            elif stat.S_ISLNK(mode):
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
                tf.addfile(info)
            elif stat.S_ISCHR(mode) and overlay_upper and st.st_rdev == 0:
                parent, _, base = name.rpartition("/")
                tf.addfile(_entry(f"{parent}/.wh.{base}" if parent else f".wh.{base}"))
            elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                info.type = tarfile.CHRTYPE if stat.S_ISCHR(mode) else tarfile.BLKTYPE
                info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
                tf.addfile(info)
            elif stat.S_ISFIFO(mode):
                info.type = tarfile.FIFOTYPE
                tf.addfile(info)
            # Sockets are left out, as tar(1) does.


def _xattr(path: str, name: str) -> bytes | None:
    try:
        return os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return None


def _entry(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0,
           mode: int = 0o644) -> tarfile.TarInfo:
    """A tar entry this module makes itself: root-owned, dated :data:`_SOURCE_DATE`."""
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode, info.mtime = kind, size, mode, _SOURCE_DATE
    return info


def _json_blob(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _blob_name(digest: str) -> str:
    return "blobs/sha256/" + digest.removeprefix("sha256:")


class _Archive:
    """An OCI image layout, written into one tar file in this order::

        oci-layout, blobs/, blobs/sha256/, layer blobs..., config, manifest, index.json

    Layers are streamed straight into the archive (never a separate tar file): each goes in
    behind a placeholder header, hashed on the way, and the real header (named by the digest,
    with the size) is written over the placeholder afterwards, in the GNU format whose header
    is one 512-byte block whatever the size. Because the first layer comes first, an archive
    cut right after it is the start of every later archive with the same first layer: the
    worker's rebuild truncates the previous archive there and appends (:meth:`resume`), and its
    5.7 GB are neither copied nor re-read.
    """

    _PREFIX = ("oci-layout", "blobs", "blobs/sha256")

    def __init__(self, f: BinaryIO, layers: Sequence[Layer] = ()) -> None:
        self.f = f
        self.layers = list(layers)
        if not layers:
            self._small("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
            for d in self._PREFIX[1:]:
                self.f.write(_entry(d, tarfile.DIRTYPE, mode=0o755).tobuf(tarfile.PAX_FORMAT))

    @classmethod
    def first_layer_end(cls, path: Path, layer: Layer) -> int | None:
        """Where ``layer`` ends in the archive ``path`` if it is its first layer, else None."""
        try:
            with tarfile.open(path) as tf:
                members = [tf.next() for _ in range(len(cls._PREFIX) + 1)]
        except (OSError, tarfile.TarError):
            return None
        if None in members or [m.name for m in members[:-1]] != list(cls._PREFIX):
            return None
        blob = members[-1]
        if blob.name != _blob_name(layer.digest) or blob.size != layer.size:
            return None
        return blob.offset_data + blob.size + (-blob.size % tarfile.BLOCKSIZE)

    @classmethod
    def resume(cls, f: BinaryIO, first: Layer, end: int) -> _Archive:
        """Continue an archive whose first layer ``first`` ends at ``end``: cut the rest."""
        f.truncate(end)
        f.seek(end)
        return cls(f, [first])

    def layer(self, write: Callable[[BinaryIO], None]) -> Layer:
        """Add the layer that ``write(file)`` writes; return its digest and size."""
        start = self.f.tell()
        self.f.write(bytes(tarfile.BLOCKSIZE))
        out = _HashingWriter(self.f)
        write(out)  # type: ignore[arg-type]
        layer = Layer(out.digest, out.size)
        header = _entry(_blob_name(layer.digest), size=layer.size).tobuf(tarfile.GNU_FORMAT)
        assert len(header) == tarfile.BLOCKSIZE, "a blob header must be one block"
        self.f.seek(start)
        self.f.write(header)
        self.f.seek(0, os.SEEK_END)
        self._pad(layer.size)
        self.layers.append(layer)
        return layer

    def finish(self, ref: str, config: dict, history: Sequence[str]) -> None:
        """Write the config, the manifest and the index naming the image ``ref``.

        ``ctr images import`` names the image after ``io.containerd.image.name``, else after
        ``org.opencontainers.image.ref.name`` (containerd 1.6.20 keeps a full reference there,
        and turns a bare tag into ``import-<date>:<tag>``): both carry the full reference.
        """
        image_config = {
            "architecture": _go_arch(), "os": "linux", "config": config,
            "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in self.layers]},
            "history": [{"created_by": line} for line in history],
        }
        config_blob = _json_blob(image_config)
        manifest_blob = _json_blob({
            "schemaVersion": 2, "mediaType": _MANIFEST,
            "config": {"mediaType": _CONFIG, "digest": _digest(config_blob),
                       "size": len(config_blob)},
            "layers": [{"mediaType": _LAYER_TAR, "digest": layer.digest, "size": layer.size}
                       for layer in self.layers],
        })
        index_blob = _json_blob({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{
                "mediaType": _MANIFEST, "digest": _digest(manifest_blob),
                "size": len(manifest_blob),
                "platform": {"architecture": _go_arch(), "os": "linux"},
                "annotations": {"io.containerd.image.name": ref,
                                "org.opencontainers.image.ref.name": ref},
            }],
        })
        self._small(_blob_name(_digest(config_blob)), config_blob)
        self._small(_blob_name(_digest(manifest_blob)), manifest_blob)
        self._small("index.json", index_blob)
        self.f.write(bytes(2 * tarfile.BLOCKSIZE))
        self._pad(self.f.tell(), tarfile.RECORDSIZE)  # whole 10 KiB records, as tar(1) writes
        self.f.flush()
        os.fsync(self.f.fileno())

    def _small(self, name: str, data: bytes) -> None:
        self.f.write(_entry(name, size=len(data)).tobuf(tarfile.PAX_FORMAT))
        self.f.write(data)
        self._pad(len(data))

    def _pad(self, size: int, unit: int = tarfile.BLOCKSIZE) -> None:
        self.f.write(bytes(-size % unit))


# --------------------------------------------------------------------------------------------
# Building


def _require(*commands: str) -> None:
    missing = [c for c in commands if shutil.which(c) is None]
    if missing:
        raise ImageBuildError(
            f"building the dev cluster's images needs {', '.join(missing)}: install them "
            f"(Debian: tools/install-debs.sh debootstrap)")


def _check_output(argv: Sequence[str], *, what: str, timeout: float,
                  cwd: Path | None = None) -> str:
    return check_output(argv, what=what, timeout=timeout, cwd=cwd, error=ImageBuildError)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _busybox_deb(cache: Path, log: Log) -> Path:
    """Debian's busybox-static package: from this cache, apt's archive cache, or the mirror.

    Once here, it is kept: a newer busybox makes no better pause image, and later builds need
    neither apt's package lists nor network.
    """
    debs = cache / "debs"
    found = sorted(debs.glob("busybox-static_*.deb"))
    if found:
        return found[-1]
    _require("apt-get", "dpkg-deb")
    debs.mkdir(parents=True, exist_ok=True)
    uris = _check_output(["apt-get", "download", "--print-uris", "busybox-static"],
                         what="locating Debian's busybox-static package (apt-get update first "
                         "if apt has no package lists)", timeout=60)
    try:
        _, filename, _, checksum = uris.split()[:4]
    except ValueError:
        raise ImageBuildError(f"unexpected `apt-get download --print-uris busybox-static` "
                              f"output: {uris!r}") from None
    sha256 = checksum.removeprefix("SHA256:")
    local = Path("/var/cache/apt/archives") / filename
    with tempfile.TemporaryDirectory(dir=debs, prefix="download.tmp-") as tmp:
        if local.is_file() and _file_sha256(local) == sha256:
            shutil.copyfile(local, Path(tmp) / filename)
        else:
            log(f"{_PROGRESS} pause: apt-get download busybox-static")
            _check_output(["apt-get", "download", "busybox-static"], cwd=Path(tmp),
                          what="downloading busybox-static", timeout=300)
        got = Path(tmp) / filename
        if not got.is_file() or _file_sha256(got) != sha256:
            raise ImageBuildError(f"busybox-static: {got} is missing or does not have the "
                                  f"SHA256 {sha256} apt announced")
        got.rename(debs / filename)
    return debs / filename


class _Build:
    """One image build: progress lines, commands logged to one file, errors that name them."""

    def __init__(self, label: str, log_path: Path, log: Log) -> None:
        self.label = label
        self.log_path = log_path
        self._log = log
        self._steps: list[tuple[str, float]] = []
        self._step = ""
        self.started = time.monotonic()
        log_path.write_text("")

    @contextlib.contextmanager
    def step(self, name: str, detail: str = "") -> Iterator[None]:
        """One progress line as the step starts; its duration goes into the summary line."""
        self._log(f"{_PROGRESS} {self.label}: {name}" + (f" ({detail})" if detail else ""))
        self._step, started = name, time.monotonic()
        yield
        self._steps.append((name, time.monotonic() - started))
        self._step = ""

    def summary(self) -> str:
        return ", ".join(f"{what} {secs:.0f} s" for what, secs in self._steps)

    def run(self, argv: Sequence[str], *, timeout: float, cwd: Path | None = None) -> None:
        """Run ``argv``, its output appended to the build log; raise with its tail if it fails.

        Its own session, killed as a whole on timeout or Ctrl-C, and SIGKILLed should this
        process die (``PR_SET_PDEATHSIG``), so that no build outlives its builder.
        """
        with open(self.log_path, "ab") as out:
            start = out.tell()
            out.write(f"\n$ {shlex.join(argv)}\n".encode())
            out.flush()
            try:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=cwd,
                                        start_new_session=True, preexec_fn=_die_with_parent)
            except FileNotFoundError as exc:
                raise ImageBuildError(f"{self._where()}: `{argv[0]}` not found") from exc
            try:
                rc = proc.wait(timeout=timeout)
            except BaseException as exc:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if isinstance(exc, subprocess.TimeoutExpired):
                    raise ImageBuildError(
                        f"{self._where()}: `{shlex.join(argv)}` did not finish in "
                        f"{timeout:.0f} s; log: {self.log_path}") from None
                raise
        if rc != 0:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                tail = f.read().decode(errors="replace").splitlines()[-30:]
            raise ImageBuildError(
                f"{self._where()}: `{shlex.join(argv)}` failed with exit code {rc}; log: "
                f"{self.log_path}; its last lines:\n" + "\n".join(tail))

    def _where(self) -> str:
        return f"{self.label} image, step {self._step!r}" if self._step else f"{self.label} image"

    def in_root(self, root: Path, argv: Sequence[str], *, timeout: float,
                binds: Sequence[tuple[Path, str]] = (), overlay: tuple[Path, Path, Path] |
                None = None, tmpfs: Sequence[str] = (), env: dict[str, str] | None = None
                ) -> None:
        """Run ``argv`` chrooted into ``root``, in a mount namespace of its own.

        The namespace holds /proc, /dev, the ``binds`` (host path, path in the root) and the
        ``tmpfs`` mounts, and, with ``overlay`` = (lower, upper, work), the overlay mounted on
        ``root``: they all vanish when the command exits, killed or not.
        """
        q = shlex.quote
        script = ["set -e"]
        if overlay:
            lower, upper, work = overlay
            for p in overlay:
                if any(c in str(p) for c in ",:"):
                    raise ImageBuildError(f"overlay paths cannot contain ',' or ':': {p}")
            # metacopy and redirect_dir off: every changed file is copied up whole, so the upper
            # directory is a complete layer by itself.
            script.append(f"mount -t overlay overlay -o lowerdir={q(str(lower))},"
                          f"upperdir={q(str(upper))},workdir={q(str(work))},"
                          f"metacopy=off,redirect_dir=off {q(str(root))}")
        script.append(f"mount -t proc proc {q(str(root / 'proc'))}")
        script.append(f"mount --rbind /dev {q(str(root / 'dev'))}")
        for path in tmpfs:
            script.append(f"mount -t tmpfs tmpfs {q(str(root / path.lstrip('/')))}")
        for host, inside in binds:
            script.append(f"mount --bind {q(str(host))} {q(str(root / inside.lstrip('/')))}")
        full_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "HOME": "/root", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive",
                    "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
        script.append(f"exec chroot {q(str(root))} /usr/bin/env -i "
                      + shlex.join([f"{k}={v}" for k, v in full_env.items()] + list(argv)))
        self.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                  "\n".join(script)], timeout=timeout)

    # ---- pause

    def pause(self, deb: Path, archive: Path) -> None:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=archive.parent, prefix="pause.tmp-") as tmp:
            work = Path(tmp)
            with self.step("unpack", f"dpkg-deb -x {deb.name}"):
                self.run(["dpkg-deb", "-x", str(deb), str(work / "deb")], timeout=120)
            busybox = next((p for p in (work / "deb/bin/busybox", work / "deb/usr/bin/busybox")
                            if p.is_file()), None)
            if busybox is None:
                raise ImageBuildError(f"{deb} holds no bin/busybox")
            with self.step("archive", f"layer and OCI layout into {archive.name}"):
                partial = work / archive.name
                with open(partial, "wb") as f:
                    out = _Archive(f)
                    out.layer(lambda f: _pause_tar(busybox.read_bytes(), f))
                    out.finish(PAUSE_REF, PAUSE_CONFIG, [f"busybox from {deb.name}"])
                partial.rename(archive)
        self._log(f"{_PROGRESS} pause: built {PAUSE_REF} in {time.monotonic() - started:.1f} s "
                  f"-> {archive}")
        _prune(archive.parent, "pause", archive, self.log_path)

    # ---- worker, layer 1

    def base(self, inputs: dict, dest: Path, mirror: str) -> None:
        """Layer 1's root file system: Debian, the user, the venv with the dependencies.

        Kept as a directory (``dest/rootfs``), for layer 2 to be installed onto; its tar is made
        into the first archive (:meth:`worker`), which records its digest in
        ``dest/layer.json``.
        """
        if os.geteuid() != 0:
            raise ImageBuildError("building the worker image's base needs root (debootstrap, "
                                  "chroot, mount); run as root")
        _require("debootstrap", "unshare", "chroot", "mount")
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f"{dest.name}.tmp-"))
        try:
            root = staging / "rootfs"
            debs = dest.parent / "debs"
            debs.mkdir(exist_ok=True)
            packages = ",".join(inputs["packages"])
            with self.step("debootstrap", f"--variant=minbase {SUITE} + {packages} from "
                           f"{mirror}"):
                # In a mount namespace too: the /proc and /sys debootstrap mounts in the target
                # cannot outlive it. Downloaded .debs are kept for the next bootstrap.
                self.run(["unshare", "--mount", "--propagation", "private", "debootstrap",
                          "--variant=minbase", f"--include={packages}", f"--cache-dir={debs}",
                          SUITE, str(root), mirror], timeout=3600)
            python = os.readlink(root / "usr/bin/python3")
            if python != f"python{PYTHON_VERSION}":
                raise ImageBuildError(f"{SUITE}'s /usr/bin/python3 is {python}, expected "
                                      f"python{PYTHON_VERSION}: update PYTHON_VERSION")
            with self.step("user and venv", f"useradd --uid {USER_UID} dynatrain; "
                           f"python3 -m venv {VENV}"):
                # As the Dockerfile's `useradd`: a numeric UID, so that Kubernetes'
                # runAsNonRoot can verify it.
                self.in_root(root, ["useradd", "--uid", str(USER_UID), "--create-home",
                                    "--shell", "/usr/sbin/nologin", "dynatrain"], timeout=60)
                self.in_root(root, ["python3", "-m", "venv", VENV], timeout=300)
            deps = inputs["dependencies"]
            with self.step("pip install", f"pip=={PIP_VERSION} and {len(deps)} dependencies "
                           f"(torch...) into {VENV}"):
                self._pip_install(root, [[f"pip=={PIP_VERSION}"], deps])
            with self.step("clean", "apt lists and caches, logs, pip cache"):
                _clean_root(root)
            (staging / "inputs.json").write_text(json.dumps({**inputs, "mirror": mirror},
                                                            indent=1))
            staging.rename(dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._log(f"{_PROGRESS} worker: base root file system built in "
                  f"{(time.monotonic() - started) / 60:.1f} min -> {dest}")
        _prune(dest.parent, "base", dest)

    def _pip_install(self, root: Path, batches: Sequence[Sequence[str]]) -> None:
        """pip install each batch of requirements into the venv, from PyPI (or the host's
        ``PIP_INDEX_URL``), through the host's pip cache and with the host's CA bundle (the
        network may intercept TLS with a CA that only the host trusts)."""
        pip_cache = Path(os.environ.get("PIP_CACHE_DIR") or Path(
            os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pip")
        pip_cache.mkdir(parents=True, exist_ok=True)
        (root / "root/.cache/pip").mkdir(parents=True, exist_ok=True)
        resolv = root / "etc/resolv.conf"
        resolv.unlink(missing_ok=True)
        shutil.copyfile("/etc/resolv.conf", resolv)
        env = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1",
               "PIP_PROGRESS_BAR": "off", "PIP_ROOT_USER_ACTION": "ignore"}
        for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST",
                     "PIP_DEFAULT_TIMEOUT", "http_proxy", "https_proxy", "no_proxy",
                     "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"):
            if os.environ.get(name):
                env[name] = os.environ[name]
        ca = next((Path(p) for p in (os.environ.get("PIP_CERT"),
                                     os.environ.get("REQUESTS_CA_BUNDLE"),
                                     os.environ.get("SSL_CERT_FILE"),
                                     "/etc/ssl/certs/ca-certificates.crt")
                   if p and Path(p).is_file()), None)
        if ca:
            shutil.copyfile(ca, root / "tmp/host-ca.pem")
            env["PIP_CERT"] = "/tmp/host-ca.pem"
        try:
            for batch in batches:
                self.in_root(root, [f"{VENV}/bin/python", "-m", "pip", "install", *batch],
                             binds=[(pip_cache, "/root/.cache/pip")], env=env, timeout=3600)
        finally:
            resolv.unlink(missing_ok=True)
            (root / "tmp/host-ca.pem").unlink(missing_ok=True)

    # ---- worker, layer 2 and the archive

    def worker(self, repo_root: Path, context: Sequence[str], base: Path, archive: Path) -> None:
        """Layer 2 (the project's wheel installed on top of ``base``) and the archive."""
        if os.geteuid() != 0:
            raise ImageBuildError("building the worker image needs root (chroot, mount); "
                                  "run as root")
        _require("unshare", "chroot", "mount")
        inputs = json.loads((base / "inputs.json").read_text())
        with tempfile.TemporaryDirectory(dir=archive.parent, prefix="worker.tmp-") as tmp:
            work = Path(tmp)
            with self.step("wheel", "pip wheel --no-deps of the Dockerfile's build context"):
                # From a copy of the Dockerfile's build context, as `docker build` would: a
                # setuptools build in the checkout would reuse a stale build/ directory.
                src = work / "src"
                for rel in _context_files(repo_root, context):
                    (src / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(repo_root / rel, src / rel)
                self.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir",
                          str(work / "wheels"), str(src)], timeout=600)
                wheels = sorted((work / "wheels").glob("*.whl"))
                if len(wheels) != 1:
                    raise ImageBuildError(f"pip wheel made {wheels}, expected one wheel; log: "
                                          f"{self.log_path}")
            with self.step("install", f"{wheels[0].name} onto the base, in an overlay"):
                upper, overlay_work, merged = work / "upper", work / "ovl-work", work / "merged"
                for d in (upper, overlay_work, merged):
                    d.mkdir()
                # /mnt is empty in Debian's base: mounting the wheel there and a tmpfs on /tmp
                # keeps both out of the upper directory. --no-index: the dependencies must all
                # be in the base already (they are, by its key), and pip checks that they are.
                self.in_root(merged, [f"{VENV}/bin/python", "-m", "pip", "install",
                                      "--no-index", "--no-cache-dir",
                                      f"/mnt/{wheels[0].name}"],
                             overlay=(base / "rootfs", upper, overlay_work),
                             binds=[(work / "wheels", "/mnt")], tmpfs=["/tmp"],
                             env={"PIP_DISABLE_PIP_VERSION_CHECK": "1",
                                  "PIP_ROOT_USER_ACTION": "ignore"}, timeout=600)
            history = [f"debootstrap --variant=minbase {SUITE} (+ {', '.join(inputs['packages'])});"
                       f" useradd --uid {USER_UID} dynatrain; python3 -m venv {VENV}; pip install "
                       f"pip=={PIP_VERSION} {' '.join(inputs['dependencies'])}",
                       f"pip install {wheels[0].name}"]
            partial = work / archive.name
            base_layer, previous = self._previous_archive(base, archive.parent)
            if previous is not None:
                with self.step("archive", f"layer 2 appended to the base layer of {previous.name}"):
                    # Exclusive: imports of the previous archive (import_images holds it
                    # shared) finish first; once renamed, no one can open it by its old name.
                    with open(previous, "rb") as held:
                        fcntl.flock(held, fcntl.LOCK_EX)
                        end = _Archive.first_layer_end(previous, base_layer)
                        if end is None:
                            raise ImageBuildError(f"{previous} changed while being reused")
                        previous.rename(partial)
                    with open(partial, "r+b") as f:
                        out = _Archive.resume(f, base_layer, end)
                        layer = out.layer(lambda f: tar_tree(upper, f, overlay_upper=True))
                        out.finish(WORKER_REF, WORKER_CONFIG, history)
            else:
                with self.step("archive", "tar of the base root file system and layer 2 into "
                               f"{archive.name}"):
                    with open(partial, "wb") as f:
                        out = _Archive(f)
                        base_layer = out.layer(lambda f: tar_tree(
                            base / "rootfs", f, skip_contents=("dev", "proc", "sys")))
                        layer = out.layer(lambda f: tar_tree(upper, f, overlay_upper=True))
                        out.finish(WORKER_REF, WORKER_CONFIG, history)
                    _write_json(base / "layer.json", {"digest": base_layer.digest,
                                                      "size": base_layer.size})
            partial.rename(archive)
        self._log(f"{_PROGRESS} worker: built {WORKER_REF} in "
                  f"{time.monotonic() - self.started:.1f} s ({self.summary()}; layers "
                  f"{_size(base_layer.size)} + {_size(layer.size)}) -> {archive}")
        _prune(archive.parent, "worker", archive, self.log_path)

    def _previous_archive(self, base: Path, cache: Path) -> tuple[Layer | None, Path | None]:
        """The base's layer, and a worker archive that starts with it, if there are."""
        try:
            info = json.loads((base / "layer.json").read_text())
        except (OSError, ValueError):
            return None, None
        layer = Layer(info["digest"], info["size"])
        for candidate in sorted(cache.glob("worker-*.tar"), key=lambda p: -p.stat().st_mtime):
            if _Archive.first_layer_end(candidate, layer) is not None:
                return layer, candidate
        return layer, None


def _write_json(path: Path, obj: object) -> None:
    partial = path.with_name(path.name + ".tmp-w")
    partial.write_text(json.dumps(obj, indent=1))
    partial.rename(path)


def _clean_root(root: Path) -> None:
    """What a Dockerfile's ``rm -rf /var/lib/apt/lists/*`` and ``--no-cache-dir`` leave out."""
    def empty(rel: str, pattern: str = "*") -> None:
        for p in (root / rel).glob(pattern):
            if p.is_dir() and not p.is_symlink():
                if p.name != "partial":
                    shutil.rmtree(p)
            else:
                p.unlink()
    empty("var/cache/apt", "*.bin")
    empty("var/cache/apt/archives", "*.deb")
    empty("var/lib/apt/lists")
    empty("var/cache/debconf", "*-old")
    empty("var/log", "*.log")
    empty("var/log/apt")
    empty("tmp")
    empty("var/tmp")
    shutil.rmtree(root / "root/.cache", ignore_errors=True)
    # The runtime provides resolv.conf and hostname (the CRI bind-mounts them).
    for rel in ("etc/resolv.conf", "etc/hostname"):
        (root / rel).unlink(missing_ok=True)


def _pause_tar(busybox: bytes, out: BinaryIO) -> None:
    """busybox as /bin/busybox, sh and sleep, and the directories runc mounts onto."""
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for d in ("bin", "dev", "etc", "proc", "sys", "tmp"):
            tf.addfile(_entry(d, tarfile.DIRTYPE, mode=0o1777 if d == "tmp" else 0o755))
        tf.addfile(_entry("bin/busybox", size=len(busybox), mode=0o755), io.BytesIO(busybox))
        for applet in ("sh", "sleep"):
            info = _entry(f"bin/{applet}", tarfile.SYMTYPE, mode=0o777)
            info.linkname = "busybox"
            tf.addfile(info)


# --------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynatrain.devcluster.images",
        description="Build the dev cluster's container images as OCI archives (cached under "
                    f"{images_cache()}) and print where they are. The worker image needs "
                    "root and network; `ctr -n k8s.io images import ARCHIVE` loads one.")
    parser.add_argument("images", nargs="*", metavar="IMAGE",
                        help="pause and/or worker (default: both)")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the DynaTrain checkout the worker image is built from "
                             "(default: %(default)s)")
    parser.add_argument("--mirror", help="Debian mirror for debootstrap (default: the host's, "
                        f"{debian_mirror()})")
    args = parser.parse_args(argv)
    wanted = args.images or ["pause", "worker"]
    unknown = sorted(set(wanted) - {"pause", "worker"})
    if unknown:
        parser.error(f"unknown image(s) {', '.join(unknown)}: choose pause and/or worker")
    try:
        for name in dict.fromkeys(wanted):
            started = time.monotonic()
            image = (pause_image() if name == "pause"
                     else worker_image(args.repo, mirror=args.mirror))
            print(f"{image.ref}: {image.archive} ({_size(image.archive.stat().st_size)}, "
                  f"layers {', '.join(_size(layer.size) for layer in image.layers)}; manifest "
                  f"{image.manifest_digest}; {time.monotonic() - started:.1f} s)")
    except ImageBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
