"""The dev cluster's container images, built on this machine with Debian's own tools.

The dev cluster's real node (:mod:`.kubelet`: a kubelet with containerd and runc) runs pods
from images, and no container registry is reachable where DynaTrain is developed and tested,
nor is Docker there to build with. So the images its pods need are built here, as OCI
image-layout archives (``oci-layout``, ``index.json``, ``blobs/sha256/...`` in one tar) that
``ctr images import`` loads into the node's containerd (:func:`import_images`):

- ``localhost/dynatrain-pause:dev`` (:func:`pause_image`), containerd's ``sandbox_image``:
  Debian's statically linked busybox (package ``busybox-static``) running a shell that sleeps
  until SIGTERM or SIGINT, then exits 0;
- ``localhost/dynatrain-operator:dev`` (:func:`operator_image`), the Dockerfile's ``operator``
  target: built as the worker image below, with operator/requirements.txt in its venv instead
  of the project's dependencies and the wheel installed ``--no-deps`` (no torch; 390 MiB);
- ``localhost/dynatrain:dev`` (:func:`worker_image`), the project's image for the workers,
  made as the repository's ``Dockerfile`` makes it but with Debian's tools instead
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
appended (:class:`.ocilayout._Archive`); its 5.7 GB are neither copied nor re-read, and its
digest comes from the cache (``base-<key>/layer.json``).

**Cache.** ``~/.cache/dynatrain/images/`` (``$XDG_CACHE_HOME``; ``DYNATRAIN_IMAGES_CACHE``
overrides it), entries named by a hash of their inputs: ``pause-<key>.tar``, ``debian-<key>/``
(Debian from debootstrap, the user and an empty venv: the root file system the worker's and the
operator's bases are copied from, so a cold build debootstraps once), ``base-<key>/`` and
``slim-base-<key>/`` (layer 1's ``rootfs/``, its ``inputs.json`` and ``layer.json``) and
``worker-<key>.tar``, each made under a temporary name and renamed when complete, under a file
lock that serialises concurrent builders (the second waits, then reuses the first one's result).
A new entry replaces the older ones of its kind, so the worker takes ~12 GB (root file system
and archive). :func:`import_images` holds an archive's lock shared while ``ctr`` reads it, so a
rebuild cannot cut an archive that is being imported.

**Build.** Building the worker image needs root (``debootstrap``, ``chroot``, ``mount``) and
network (the Debian mirror named in ``/etc/apt/sources.list.d/debian.sources``, PyPI). Each
command runs in its own mount namespace (``unshare --mount``), so the ``/proc``, ``/dev``,
pip-cache and overlay mounts it makes vanish when it exits, whatever happens. pip inside the
root file system uses the host's pip cache (bind-mounted) and CA bundle. Each step prints one
progress line; a failing step raises :class:`ImageBuildError` naming the command, its exit
code, the tail of its output and the build log (``<cache>/<kind>-<key>.log``).

By hand: ``python -m dynatrain.devcluster.images [--repo DIR] [pause] [worker] [operator]``.

**Modules.** This module holds the entry points (:func:`pause_image`, :func:`worker_image`,
:func:`import_images`) and the command line; the rest moved out, one role each, and the names
others use are re-exported here: what the images are, their inputs and cache keys in
:mod:`.imagespec`; the OCI format (layer tars, the archive) in :mod:`.ocilayout`; the builder
and the cache's lock and pruning in :mod:`.imagebuild`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from .imagebuild import _Build, _busybox_deb, _cache_lock, _check_output, _size
# Of the names below, the public ones (in __all__) are re-exported: other modules and the tests
# use them from here.
from .imagespec import (
    _ARCHIVE_FORMAT, _PROGRESS, DEBIAN_PACKAGES, DEFAULT_MIRROR, PAUSE_CONFIG, PAUSE_REF,
    PAUSE_SCRIPT, PIP_VERSION, PROJECT_IMAGES, PYTHON_VERSION, SUITE, USER_HOME, USER_UID, VENV,
    WORKER_CONFIG, WORKER_REF, OPERATOR_CONFIG, OPERATOR_REF, ImageBuildError, Log,
    _base_inputs, _build_context, _debian_inputs, _file_sha256, _hash, _tree_hash,
    debian_mirror, images_cache,
)
from .ocilayout import Image, Layer, _go_arch, _read_image, tar_tree

__all__ = [
    "DEBIAN_PACKAGES", "DEFAULT_MIRROR", "PAUSE_CONFIG", "PAUSE_REF", "PAUSE_SCRIPT",
    "PIP_VERSION", "PYTHON_VERSION", "SUITE", "USER_HOME", "USER_UID", "VENV", "WORKER_CONFIG",
    "WORKER_REF", "OPERATOR_CONFIG", "OPERATOR_REF", "PROJECT_IMAGES", "Image", "ImageBuildError",
    "Layer", "Log", "debian_mirror", "images_cache", "import_images", "main", "operator_image",
    "pause_image", "project_image", "tar_tree", "worker_image",
]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
    return project_image("worker", repo_root, mirror=mirror, log=log)


def operator_image(repo_root: Path, *, mirror: str | None = None,
                   log: Log | None = None) -> Image:
    """The slim operator image (``localhost/dynatrain-operator:dev``), the Dockerfile's
    ``operator`` target: the worker's Debian, user and venv, with only
    operator/requirements.txt in it (no torch) and the project's wheel installed ``--no-deps``.
    Cached as the worker image is; its layer 1 is about 390 MiB instead of 5.7 GiB."""
    return project_image("operator", repo_root, mirror=mirror, log=log)


def project_image(kind: str, repo_root: Path, *, mirror: str | None = None,
                  log: Log | None = None) -> Image:
    """The project image ``kind`` (a key of :data:`PROJECT_IMAGES`: ``worker``, ``operator``)
    from the checkout at ``repo_root``, built first if not cached."""
    if kind not in PROJECT_IMAGES:
        raise ImageBuildError(f"unknown project image {kind!r}; known: {sorted(PROJECT_IMAGES)}")
    image = PROJECT_IMAGES[kind]
    log = log or _stderr
    repo_root = Path(repo_root).resolve()
    cache = images_cache()
    base_inputs = _base_inputs(repo_root, image.kind)
    base_key = _hash(base_inputs)
    context = _build_context(repo_root)
    key = _hash({"format": _ARCHIVE_FORMAT, "base": base_key,
                 "context": _tree_hash(repo_root, context), "config": image.config})
    archive = cache / f"{image.kind}-{key}.tar"
    if not archive.is_file():
        with _cache_lock(cache):
            if not archive.is_file():
                build = _Build(image.kind, cache / f"{image.kind}-{key}.log", log)
                base = cache / f"{image.base_prefix}-{base_key}"
                if not (base / "inputs.json").is_file():
                    # Debian, the user and the venv, shared by the worker's and the
                    # operator's bases: debootstrapped once for both.
                    debian_inputs = _debian_inputs(base_inputs)
                    debian = cache / f"debian-{_hash(debian_inputs)}"
                    if not (debian / "inputs.json").is_file():
                        build.debian(debian_inputs, debian, mirror or debian_mirror())
                    build.base(base_inputs, base, debian, prefix=image.base_prefix)
                build.project(image, repo_root, context, base, archive)
    return _read_image(archive, image.ref)


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


# --------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynatrain.devcluster.images",
        description="Build the dev cluster's container images as OCI archives (cached under "
                    f"{images_cache()}) and print where they are. The worker image needs "
                    "root and network; `ctr -n k8s.io images import ARCHIVE` loads one.")
    parser.add_argument("images", nargs="*", metavar="IMAGE",
                        help="pause, worker and/or operator (default: pause and worker)")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the DynaTrain checkout the worker image is built from "
                             "(default: %(default)s)")
    parser.add_argument("--mirror", help="Debian mirror for debootstrap (default: the host's, "
                        f"{debian_mirror()})")
    args = parser.parse_args(argv)
    wanted = args.images or ["pause", "worker"]
    unknown = sorted(set(wanted) - {"pause", *PROJECT_IMAGES})
    if unknown:
        parser.error(f"unknown image(s) {', '.join(unknown)}: choose from pause, "
                     f"{', '.join(PROJECT_IMAGES)}")
    try:
        for name in dict.fromkeys(wanted):
            started = time.monotonic()
            image = (pause_image() if name == "pause"
                     else project_image(name, args.repo, mirror=args.mirror))
            print(f"{image.ref}: {image.archive} ({_size(image.archive.stat().st_size)}, "
                  f"layers {', '.join(_size(layer.size) for layer in image.layers)}; manifest "
                  f"{image.manifest_digest}; {time.monotonic() - started:.1f} s)")
    except ImageBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
