"""The OCI image format: layer tars and image-layout archives, written and read back.

The format side of :mod:`.images`: :class:`Layer` and :class:`Image` (what a built archive
holds), :func:`tar_tree` (a directory, or an overlayfs upper directory, as a deterministic
uncompressed layer), :class:`_Archive` (an OCI image layout streamed into one tar, which a
rebuild can cut after its first layer and append to) and :func:`_read_image` (an archive's
manifest digest and layers, read back). Separate because it knows nothing of Debian, pip or
the cache: it only writes and reads bytes in the layout ``ctr images import`` loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import stat
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_SOURCE_DATE = 0
"""mtime of the files this module makes itself (the pause layer), so its digest is stable."""
_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_CONFIG = "application/vnd.oci.image.config.v1+json"


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


def _go_arch() -> str:
    """The host's architecture as OCI (Go) names it; debootstrap builds for the host's."""
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64", "ppc64le": "ppc64le",
            "s390x": "s390x"}.get(machine, machine)


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
