"""What the dev cluster's container images are: their names, contents and cache keys.

The specification side of :mod:`.images`: the image references, the Debian suite, Python,
pip and user the project's images (worker and slim operator, :data:`PROJECT_IMAGES`) are made
of, the images' configs (entry point, user, environment), the error every build step raises,
where the cache lives and how the inputs of an image (``pyproject.toml``'s dependencies, the
Dockerfile's build context, the host's Debian mirror) are read and hashed into the keys that
name its cache entries. Separate from the
builder (:mod:`.imagebuild`) and the archive format (:mod:`.ocilayout`) so that what an image
holds can be read, and changed, in one place; it runs no command.
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from dataclasses import dataclass
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from .errors import DevClusterError
from .gobuild import cache_root
from .ocilayout import _go_arch

PAUSE_REF = "localhost/dynatrain-pause:dev"
WORKER_REF = "localhost/dynatrain:dev"
OPERATOR_REF = "localhost/dynatrain-operator:dev"

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

OPERATOR_CONFIG = {
    # The Dockerfile's `operator` target: the worker's user, environment and entry point, the
    # operator's two ports (liveness, metrics) and its `operator --help`.
    **WORKER_CONFIG,
    "Cmd": ["operator", "--help"],
    "ExposedPorts": {"8080/tcp": {}, "9090/tcp": {}},
}


@dataclass(frozen=True)
class ProjectImage:
    """One of the two images made of the project's wheel (the Dockerfile's two targets)."""

    kind: str
    """``worker`` or ``operator``: the name of its cache entries (``<kind>-<key>.tar``)."""
    ref: str
    config: dict
    base_prefix: str
    """The name of its layer-1 cache entries (``<base_prefix>-<key>/``)."""
    no_deps: bool
    """Install the wheel without its dependencies (the operator: its layer 1 holds only
    operator/requirements.txt, no torch)."""


PROJECT_IMAGES = {
    "worker": ProjectImage("worker", WORKER_REF, WORKER_CONFIG, "base", no_deps=False),
    "operator": ProjectImage("operator", OPERATOR_REF, OPERATOR_CONFIG, "slim-base",
                             no_deps=True),
}
OPERATOR_REQUIREMENTS = "operator/requirements.txt"

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
_PROGRESS = "[images]"


class ImageBuildError(DevClusterError):
    """An image could not be built or imported; the message names the command and its output."""


Log = Callable[[str], None]


def images_cache() -> Path:
    """``$DYNATRAIN_IMAGES_CACHE``, else ``$XDG_CACHE_HOME/dynatrain/images``."""
    return cache_root("images", "DYNATRAIN_IMAGES_CACHE")


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


def _base_inputs(repo_root: Path, kind: str = "worker") -> dict:
    """What decides layer 1's content (its cache key): for the worker, pyproject.toml's
    dependencies; for the operator, operator/requirements.txt's."""
    if kind == "operator":
        path = repo_root / OPERATOR_REQUIREMENTS
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ImageBuildError(f"cannot read the operator's requirements: {exc}") from exc
        deps = [ln.split("#", 1)[0].strip() for ln in lines]
        return {"format": _BASE_FORMAT, "image": "operator", "suite": SUITE,
                "packages": list(DEBIAN_PACKAGES), "python": PYTHON_VERSION,
                "pip": PIP_VERSION, "arch": _go_arch(), "uid": USER_UID, "venv": VENV,
                "dependencies": [d for d in deps if d]}
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


def _debian_inputs(base_inputs: dict) -> dict:
    """What decides the Debian stage both bases are copied from (its cache key): a base's
    inputs without what only its venv's packages depend on."""
    return {k: v for k, v in base_inputs.items() if k not in ("image", "pip", "dependencies")}


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
