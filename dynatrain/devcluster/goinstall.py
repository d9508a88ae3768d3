"""A Go command for a wrapper module's go.mod: the one on PATH, or a toolchain installed for it.

The Go builder (:mod:`.gobuild`) needs a Go at least as new as the ``go`` line of the module it
builds (``go 1.26.0`` in ``tools/k8s`` and ``tools/helm``). This module finds one, so that
``make test`` works on a machine without Go or with an old one (Debian bookworm's 1.19):

- **go on PATH** is used when it can build the module: it is at least the ``go`` line, or it is
  at least Go 1.21 and fetches the required toolchain itself (``GOTOOLCHAIN=auto``, Go's
  default; with ``GOTOOLCHAIN=local`` it must be new enough on its own);
- **otherwise** the toolchain the go.mod names (its ``toolchain`` line, else its ``go`` line)
  is downloaded for this OS and architecture from the module proxy, as Go's own toolchain
  switch does: module ``golang.org/toolchain``, version ``v0.0.1-go<VERSION>.<GOOS>-<GOARCH>``,
  from ``$GOPROXY``'s first http(s) entry (``https://proxy.golang.org`` by default);
- **verified**: the zip's ``h1:`` hash (Go's dirhash) must equal the checksum database's,
  looked up through the same proxy (``/sumdb/sum.golang.org/lookup/...``). The note's signature
  and the log's inclusion proof are not checked, so the trust placed in it is that of HTTPS to
  the proxy; a corrupt or substituted download from anywhere else is refused;
- **cache**: unpacked into ``<cache>/go<VERSION>/`` (``~/.cache/dynatrain/go`` by default, see
  :func:`.gobuild.go_command`) by one rename of a complete staging directory, under a file lock,
  so concurrent installers download once and a reader never sees half a toolchain. A cached
  toolchain at least as new as the one wanted is reused without any network access.

Only the standard library is used: :mod:`urllib.request`, :mod:`zipfile`, :mod:`hashlib`.
"""

from __future__ import annotations

import base64
import fcntl
import fnmatch
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path

from .errors import DevClusterError

DEFAULT_PROXY = "https://proxy.golang.org"
SWITCHING_SINCE = "1.21"
"""The first Go that fetches the toolchain a go.mod requires by itself (``GOTOOLCHAIN``)."""
TOOLCHAIN_MODULE = "golang.org/toolchain"

_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64",
         "i386": "386", "i686": "386", "armv6l": "arm", "armv7l": "arm", "ppc64le": "ppc64le",
         "s390x": "s390x", "riscv64": "riscv64", "loongarch64": "loong64"}
_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+)|(rc|beta)(\d+))?$")
_PROBE_TIMEOUT_S = 600   # `go env` may first download a toolchain itself (GOTOOLCHAIN=auto)
_HTTP_TIMEOUT_S = 60     # per connect and per read, not for the whole download


class GoInstallError(DevClusterError):
    """A Go toolchain was downloaded but failed its checks, or the go.mod names no Go."""


class DownloadFailed(GoInstallError):
    """No toolchain could be downloaded (no network, no proxy, no build for this platform)."""


# -- versions --------------------------------------------------------------------------------
def version_key(version: str) -> tuple[int, int, int, int]:
    """Sort key of a Go version (``1.26.0``, ``go1.26rc1``), in Go's own order.

    As Go's ``gover`` orders them, a language version comes before its pre-releases, and they
    before its releases: ``1.21 < 1.21beta1 < 1.21rc1 < 1.21.0 < 1.21.1``.
    """
    m = _VERSION.match(version.removeprefix("go"))
    if not m:
        raise GoInstallError(f"not a Go version: {version!r}")
    major, minor, patch, pre, pre_n = m.groups()
    if patch is not None:
        return int(major), int(minor), 3, int(patch)
    if pre is not None:
        return int(major), int(minor), 1 if pre == "beta" else 2, int(pre_n)
    return int(major), int(minor), 0, 0


def _parse_go_version(text: str) -> str | None:
    """``1.26.8`` from ``go1.26.8`` or ``go version go1.26.8 linux/amd64`` (None if absent)."""
    m = re.search(r"\bgo(\d+\.\d+(?:\.\d+|(?:rc|beta)\d+)?)", text)
    return m.group(1) if m else None


def requirements(go_mod: Path) -> tuple[str, str]:
    """``(minimum, wanted)``: the go.mod's ``go`` line, and the toolchain to install for it.

    ``wanted`` is the ``toolchain`` line if it is newer, else the ``go`` line; a language
    version such as ``1.26`` means its first release, ``1.26.0``, as Go itself reads it.
    """
    text = go_mod.read_text()
    go = re.search(r"^go\s+(\S+)\s*(?://.*)?$", text, re.MULTILINE)
    if not go:
        raise GoInstallError(f"{go_mod} has no `go` line naming the Go version it needs")
    minimum = go.group(1)
    version_key(minimum)
    wanted = minimum
    if re.fullmatch(r"\d+\.\d+", minimum) and version_key(minimum) >= version_key(
            SWITCHING_SINCE):
        wanted = minimum + ".0"
    toolchain = re.search(r"^toolchain\s+go(\S+?)(?:[-+]\S*)?\s*(?://.*)?$", text, re.MULTILINE)
    if toolchain and version_key(toolchain.group(1)) > version_key(wanted):
        wanted = toolchain.group(1)
    return minimum, wanted


# -- finding a Go ----------------------------------------------------------------------------
_found: dict[tuple, str] = {}


def find_go(go_mod: Path, cache: Path, *, log: Callable[[str], None] | None = None) -> str:
    """A Go command that can build the module of ``go_mod``: go on PATH, or an installed one.

    Installs the wanted toolchain into ``cache`` when neither go on PATH nor a cached
    toolchain will do. Raises :class:`DownloadFailed` if it cannot be downloaded and
    :class:`GoInstallError` if the download fails its checks.
    """
    log = log or _stderr
    minimum, wanted = requirements(go_mod)
    key = (str(go_mod.resolve()), minimum, wanted, str(cache), os.environ.get("PATH"),
           os.environ.get("GOTOOLCHAIN"))
    found = _found.get(key)
    if found and os.path.exists(found):
        return found
    path_go = shutil.which("go")
    if path_go:
        usable, why = _path_go_can_build(path_go, go_mod, minimum, log)
        if usable:
            _found[key] = path_go
            return path_go
    else:
        why = "no go on PATH"
    try:
        found = str(cached(cache, wanted) or install(wanted, cache, log=log, reason=why))
    except DownloadFailed as exc:
        raise DownloadFailed(f"{why}, and {exc}") from exc
    _found[key] = found
    return found


def _path_go_can_build(go: str, go_mod: Path, minimum: str,
                       log: Callable[[str], None]) -> tuple[bool, str]:
    """Whether ``go`` builds the module (itself or by switching toolchains), and why not."""
    local = _go_version(go, cwd=Path(tempfile.gettempdir()),
                        env={**os.environ, "GOTOOLCHAIN": "local"})
    if local is None:
        return False, f"{go} does not report its version"
    if version_key(local) >= version_key(minimum):
        return True, ""
    if version_key(local) < version_key(SWITCHING_SINCE):
        return False, (f"{go} is go{local}, older than {SWITCHING_SINCE}, and cannot fetch "
                       f"go{minimum} itself")
    # Go >= 1.21 fetches the go.mod's toolchain itself unless GOTOOLCHAIN forbids it: ask it.
    log(f"[go] {go} is go{local}; asking it for go{minimum} (GOTOOLCHAIN may download it)")
    switched = _go_version(go, cwd=go_mod.parent, env=dict(os.environ))
    if switched is not None and version_key(switched) >= version_key(minimum):
        return True, ""
    return False, (f"{go} is go{local} and does not switch to go{minimum} "
                   f"(GOTOOLCHAIN={os.environ.get('GOTOOLCHAIN', '<go env default>')})")


def _go_version(go: str, *, cwd: Path, env: dict[str, str]) -> str | None:
    try:
        proc = subprocess.run([go, "env", "GOVERSION"], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return _parse_go_version(proc.stdout)


def cached(cache: Path, wanted: str) -> Path | None:
    """``bin/go`` of the cached toolchain ``wanted``, else of the newest cached one newer."""
    exact = cache / f"go{wanted}" / "bin" / "go"
    if exact.is_file():
        return exact
    newer = []
    for candidate in cache.glob("go*/bin/go") if cache.is_dir() else ():
        version = candidate.parents[1].name.removeprefix("go")
        if _VERSION.match(version) and version_key(version) >= version_key(wanted):
            newer.append((version_key(version), candidate))
    return max(newer)[1] if newer else None


def toolchain_env(go: str, cache: Path) -> dict[str, str]:
    """Environment to run ``go`` with: ``GOROOT`` if it is a toolchain installed in ``cache``.

    A ``GOROOT`` left in the environment for another Go would otherwise make the installed
    ``go`` compile against that Go's standard library (Go's own toolchain switch sets it too).
    """
    path = Path(go)
    if path.is_absolute() and path.parent.name == "bin" and \
            path.parents[1].parent.resolve() == cache.resolve():
        return {"GOROOT": str(path.parents[1])}
    return {}


# -- installing one --------------------------------------------------------------------------
def goos_goarch() -> str:
    """This machine's ``GOOS-GOARCH`` as toolchain module versions spell it (``linux-amd64``)."""
    system, machine = platform.system().lower(), platform.machine().lower()
    arch = _ARCH.get(machine)
    if system not in ("linux", "darwin", "freebsd", "openbsd", "netbsd") or arch is None:
        raise DownloadFailed(f"no Go toolchain download for this platform ({platform.system()} "
                             f"{platform.machine()}): install Go yourself (https://go.dev/dl/)")
    return f"{system}-{arch}"


def proxy_url() -> str:
    """The first http(s) entry of ``$GOPROXY``; ``https://proxy.golang.org`` if it is unset."""
    value = os.environ.get("GOPROXY", "").strip()
    if not value:
        return DEFAULT_PROXY
    for entry in re.split(r"[,|]", value):
        entry = entry.strip()
        if entry.startswith(("https://", "http://")):
            return entry.rstrip("/")
    raise DownloadFailed(f"GOPROXY={value!r} names no http(s) module proxy to download the Go "
                         "toolchain from: set GOPROXY=https://proxy.golang.org (or a mirror), "
                         "or install Go yourself (https://go.dev/dl/)")


def install(version: str, cache: Path, *, log: Callable[[str], None] | None = None,
            reason: str = "") -> Path:
    """Download, verify and unpack toolchain ``go<version>`` into ``cache``; its ``bin/go``."""
    log = log or _stderr
    target = cache / f"go{version}"
    go = target / "bin" / "go"
    if go.is_file():
        return go
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".go{version}.lock", "w") as lock:
        # Another process may be installing the same toolchain: wait, then reuse its result.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if go.is_file():
            return go
        for stale in cache.glob(f".go{version}-*.tmp"):    # left by an interrupted install
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        _install_locked(version, target, log, reason)
    return go


def _install_locked(version: str, target: Path, log: Callable[[str], None],
                    reason: str) -> None:
    started = time.monotonic()
    proxy = proxy_url()
    module_version = f"v0.0.1-go{version}.{goos_goarch()}"
    zip_url = f"{proxy}/{TOOLCHAIN_MODULE}/@v/{module_version}.zip"
    expected = _sumdb_hash(proxy, module_version)
    cache = target.parent
    fd, zip_name = tempfile.mkstemp(prefix=f".go{version}-", suffix=".zip.tmp", dir=cache)
    zip_path = Path(zip_name)
    staging = Path(tempfile.mkdtemp(prefix=f".go{version}-", suffix=".tmp", dir=cache))
    try:
        with os.fdopen(fd, "wb") as out:
            with _open(zip_url, f"the Go toolchain go{version} for {goos_goarch()}") as resp:
                size = int(resp.headers.get("Content-Length") or 0)
                log(f"[go] {reason + '; ' if reason else ''}downloading go{version} "
                    f"({size / 1e6:.0f} MB) from {zip_url}")
                try:
                    shutil.copyfileobj(resp, out, 1 << 20)
                except OSError as exc:
                    raise DownloadFailed(f"downloading {zip_url} failed: {exc}; {_ADVICE}") \
                        from exc
        got = dirhash(zip_path)
        if got != expected:
            raise GoInstallError(
                f"the Go toolchain go{version} downloaded from {zip_url} does not match the "
                f"checksum database: it hashes to {got}, sum.golang.org says {expected}; "
                "nothing was installed (the download was corrupted or altered on its way)")
        _unpack(zip_path, f"{TOOLCHAIN_MODULE}@{module_version}/", staging)
        check = subprocess.run([str(staging / "bin" / "go"), "version"], capture_output=True,
                               text=True, timeout=60, env={**os.environ, "GOROOT": str(staging),
                                                           "GOTOOLCHAIN": "local"})
        if _parse_go_version(check.stdout) != version:
            raise GoInstallError(f"the unpacked go{version} in {staging} does not run: `go "
                                 f"version` printed {(check.stdout + check.stderr).strip()!r}")
        if target.exists():      # not a complete toolchain (we hold the lock and bin/go is absent)
            shutil.rmtree(target)
        staging.chmod(0o755)     # mkdtemp made it private
        staging.rename(target)
    finally:
        zip_path.unlink(missing_ok=True)
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    log(f"[go] go{version} verified ({expected}) and unpacked in "
        f"{time.monotonic() - started:.1f} s -> {target / 'bin' / 'go'}")


_ADVICE = ("check the network or set GOPROXY to a reachable module proxy, or install Go "
           ">= 1.21 yourself (https://go.dev/dl/ or the distribution's package)")


def _open(url: str, what: str):
    request = urllib.request.Request(url, headers={"User-Agent": "dynatrain-goinstall"})
    try:
        return urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        raise DownloadFailed(f"downloading {what} from {url} failed: HTTP {exc.code} "
                             f"{exc.reason}; {_ADVICE}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DownloadFailed(f"downloading {what} from {url} failed: {reason}; {_ADVICE}") \
            from exc


def _sumdb_hash(proxy: str, module_version: str) -> str:
    """The ``h1:`` hash the checksum database records for the toolchain module version."""
    url = f"{proxy}/sumdb/sum.golang.org/lookup/{TOOLCHAIN_MODULE}@{module_version}"
    with _open(url, "the toolchain's checksum") as resp:
        try:
            text = resp.read().decode()
        except OSError as exc:
            raise DownloadFailed(f"downloading {url} failed: {exc}; {_ADVICE}") from exc
    for line in text.splitlines():
        fields = line.split()
        if fields[:2] == [TOOLCHAIN_MODULE, module_version] and len(fields) == 3 \
                and fields[2].startswith("h1:"):
            return fields[2]
    raise GoInstallError(f"the checksum database's answer at {url} has no h1: line for "
                         f"{TOOLCHAIN_MODULE} {module_version}:\n{text[:500]}")


def dirhash(zip_path: Path) -> str:
    """Go's ``dirhash.HashZip(zip, Hash1)``: the ``h1:`` hash go.sum and the sumdb record.

    SHA-256 over one line ``"<sha256 hex>  <name>\\n"`` per file, sorted by name (names as
    the zip stores them, bytes, with the ``module@version/`` prefix), in base64.
    """
    lines = []
    with zipfile.ZipFile(zip_path) as z:
        for info in z.infolist():
            # zipfile decodes names without the UTF-8 flag as cp437; Go hashes the raw bytes.
            raw = info.filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
            if b"\n" in raw:
                raise GoInstallError(f"{zip_path}: a file name with a newline: {raw!r}")
            digest = hashlib.sha256()
            with z.open(info) as src:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    digest.update(chunk)
            lines.append((raw, digest.hexdigest()))
    names = [raw for raw, _ in lines]
    if len(set(names)) != len(names):
        raise GoInstallError(f"{zip_path}: duplicate file names")
    total = hashlib.sha256()
    for raw, hexdigest in sorted(lines):
        total.update(hexdigest.encode() + b"  " + raw + b"\n")
    return "h1:" + base64.b64encode(total.digest()).decode()


def _unpack(zip_path: Path, prefix: str, dest: Path) -> None:
    """Extract a toolchain module zip's files (under ``prefix``) into ``dest`` as a GOROOT."""
    with zipfile.ZipFile(zip_path) as z:
        for info in z.infolist():
            name = info.filename
            if name.endswith("/"):
                continue
            rel = name.removeprefix(prefix)
            parts = rel.split("/")
            if rel == name or rel.startswith("/") or ".." in parts or "" in parts:
                raise GoInstallError(f"{zip_path}: unexpected file {name!r} (outside {prefix})")
            out = dest.joinpath(*parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            executable = (info.external_attr >> 16) & 0o111 or _needs_exec(rel)
            out.chmod(0o755 if executable else 0o644)
    # Module zips cannot hold nested go.mod files, so the toolchain ships them as _go.mod;
    # Go's own switch copies each back to go.mod (src/go.mod makes std a module).
    for underscored in dest.rglob("_go.mod"):
        shutil.copyfile(underscored, underscored.with_name("go.mod"))


def _needs_exec(rel: str) -> bool:
    """The files Go's toolchain switch makes executable (the zip's modes aside)."""
    return rel.startswith(("bin/", "pkg/tool/")) or (
        rel.startswith("lib/") and fnmatch.fnmatch(rel.rsplit("/", 1)[-1], "go_?*_?*_exec"))


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
