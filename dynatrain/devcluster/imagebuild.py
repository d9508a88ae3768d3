"""The image builder: the commands that make the dev cluster's images, and their cache.

The build side of :mod:`.images`: :class:`_Build` runs each step (debootstrap, useradd, the
venv and pip installs into the root file system, the wheel installed in an overlay, the
archive) as logged commands in mount namespaces of their own, with one progress line per step
and errors that name the command; around it, the cache's lock and pruning, the download of
Debian's busybox-static for the pause image and the clean-up of a root file system. Separate
because it is the only part that runs commands, needs root and network, and changes the
cache; what it builds is specified in :mod:`.imagespec`, written by :mod:`.ocilayout`.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from .imagespec import (
    _PROGRESS, PAUSE_CONFIG, PAUSE_REF, PIP_VERSION, PYTHON_VERSION, SUITE, USER_UID, VENV,
    ImageBuildError, Log, ProjectImage, _context_files, _file_sha256,
)
from .ocilayout import Layer, _Archive, _entry, tar_tree
from .processes import _die_with_parent, check_output


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


@contextlib.contextmanager
def _staged(dest: Path, inputs: dict) -> Iterator[Path]:
    """A cache entry built in a temporary directory beside ``dest``, with its ``inputs.json``,
    and renamed to ``dest`` when complete; removed if anything fails (what a killed build
    leaves is cleared by the next lock holder, :func:`_cache_lock`)."""
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f"{dest.name}.tmp-"))
    try:
        yield staging
        (staging / "inputs.json").write_text(json.dumps(inputs, indent=1))
        staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


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

    # ---- a project image (worker or operator), layer 1

    def debian(self, inputs: dict, dest: Path, mirror: str) -> None:
        """The root file system both project images start from: Debian (debootstrap), the
        user and an empty venv. Kept as ``dest/rootfs``; each base is a copy of it
        (:meth:`base`), so the worker's and the operator's images debootstrap once, not twice
        (on 2 cores beside the Go builds, each debootstrap took 73-92 s)."""
        if os.geteuid() != 0:
            raise ImageBuildError(f"building the {self.label} image's base needs root "
                                  "(debootstrap, chroot, mount); run as root")
        _require("debootstrap", "unshare", "chroot", "mount")
        started = time.monotonic()
        with _staged(dest, {**inputs, "mirror": mirror}) as staging:
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
        self._log(f"{_PROGRESS} {self.label}: Debian root file system built in "
                  f"{(time.monotonic() - started) / 60:.1f} min -> {dest}")
        _prune(dest.parent, "debian", dest)

    def base(self, inputs: dict, dest: Path, debian: Path, prefix: str = "base") -> None:
        """Layer 1's root file system: a copy of the ``debian`` stage (:meth:`debian`) with
        the dependencies in its venv (the worker's: torch & co.; the operator's:
        operator/requirements.txt).

        Kept as a directory (``dest/rootfs``), for layer 2 to be installed onto; its tar is made
        into the first archive (:meth:`project`), which records its digest in
        ``dest/layer.json``. ``prefix``: the name of this kind of base in the cache.
        """
        if os.geteuid() != 0:
            raise ImageBuildError(f"building the {self.label} image's base needs root "
                                  "(chroot, mount); run as root")
        _require("unshare", "chroot", "mount", "cp")
        started = time.monotonic()
        mirror = json.loads((debian / "inputs.json").read_text())["mirror"]
        with _staged(dest, {**inputs, "mirror": mirror}) as staging:
            root = staging / "rootfs"
            with self.step("copy", f"the Debian root file system of {debian.name}"):
                # cp -a: owners, modes, device nodes, hard links and extended attributes, as
                # debootstrap left them; a copy, not links: pip and the clean-up change files.
                self.run(["cp", "-a", "--reflink=auto", str(debian / "rootfs"), str(root)],
                         timeout=600)
            deps = inputs["dependencies"]
            with self.step("pip install", f"pip=={PIP_VERSION} and the {self.label} image's "
                           f"{len(deps)} dependencies into {VENV}"):
                self._pip_install(root, [[f"pip=={PIP_VERSION}"], deps])
            with self.step("clean", "apt lists and caches, logs, pip cache"):
                _clean_root(root)
        self._log(f"{_PROGRESS} {self.label}: base root file system built in "
                  f"{(time.monotonic() - started) / 60:.1f} min -> {dest}")
        _prune(dest.parent, prefix, dest)

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

    # ---- a project image, layer 2 and the archive

    def project(self, image: ProjectImage, repo_root: Path, context: Sequence[str], base: Path,
                archive: Path) -> None:
        """Layer 2 (the project's wheel installed on top of ``base``) and the archive."""
        if os.geteuid() != 0:
            raise ImageBuildError(f"building the {image.kind} image needs root (chroot, "
                                  "mount); run as root")
        _require("unshare", "chroot", "mount")
        inputs = json.loads((base / "inputs.json").read_text())
        with tempfile.TemporaryDirectory(dir=archive.parent, prefix=f"{image.kind}.tmp-") as tmp:
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
                # be in the base already (they are, by its key), and pip checks that they are;
                # the operator's base holds only its own (--no-deps: no torch), as the
                # Dockerfile's `operator` target installs it.
                self.in_root(merged, [f"{VENV}/bin/python", "-m", "pip", "install",
                                      "--no-index", "--no-cache-dir",
                                      *(["--no-deps"] if image.no_deps else []),
                                      f"/mnt/{wheels[0].name}"],
                             overlay=(base / "rootfs", upper, overlay_work),
                             binds=[(work / "wheels", "/mnt")], tmpfs=["/tmp"],
                             env={"PIP_DISABLE_PIP_VERSION_CHECK": "1",
                                  "PIP_ROOT_USER_ACTION": "ignore"}, timeout=600)
            history = [f"debootstrap --variant=minbase {SUITE} (+ {', '.join(inputs['packages'])});"
                       f" useradd --uid {USER_UID} dynatrain; python3 -m venv {VENV}; pip install "
                       f"pip=={PIP_VERSION} {' '.join(inputs['dependencies'])}",
                       f"pip install {'--no-deps ' if image.no_deps else ''}{wheels[0].name}"]
            partial = work / archive.name
            base_layer, previous = self._previous_archive(image, base, archive.parent)
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
                        out.finish(image.ref, image.config, history)
            else:
                with self.step("archive", "tar of the base root file system and layer 2 into "
                               f"{archive.name}"):
                    with open(partial, "wb") as f:
                        out = _Archive(f)
                        base_layer = out.layer(lambda f: tar_tree(
                            base / "rootfs", f, skip_contents=("dev", "proc", "sys")))
                        layer = out.layer(lambda f: tar_tree(upper, f, overlay_upper=True))
                        out.finish(image.ref, image.config, history)
                    _write_json(base / "layer.json", {"digest": base_layer.digest,
                                                      "size": base_layer.size})
            partial.rename(archive)
        self._log(f"{_PROGRESS} {image.kind}: built {image.ref} in "
                  f"{time.monotonic() - self.started:.1f} s ({self.summary()}; layers "
                  f"{_size(base_layer.size)} + {_size(layer.size)}) -> {archive}")
        _prune(archive.parent, image.kind, archive, self.log_path)

    def _previous_archive(self, image: ProjectImage, base: Path,
                          cache: Path) -> tuple[Layer | None, Path | None]:
        """The base's layer, and an archive of this kind that starts with it, if there are."""
        try:
            info = json.loads((base / "layer.json").read_text())
        except (OSError, ValueError):
            return None, None
        layer = Layer(info["digest"], info["size"])
        for candidate in sorted(cache.glob(f"{image.kind}-*.tar"),
                                key=lambda p: -p.stat().st_mtime):
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
