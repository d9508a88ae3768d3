"""The Go toolchain installer (dynatrain.devcluster.goinstall) and its wiring into the builder.

A machine without Go (or with Debian bookworm's 1.19) gets the toolchain a go.mod names from
the module proxy, verified against the checksum database. These tests check the parts that
decide whether that is safe and works: the ``h1:`` hash against Go's own values, one real
install whose ``go`` then builds a program with a stale ``GOROOT`` in the environment, a
mismatching hash refused (from a fake proxy on 127.0.0.1), unpacking and executable bits,
one download for concurrent installers, when go on PATH is used instead, and what a failed
download says.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import shutil
import stat
import subprocess
import threading
import zipfile
from pathlib import Path

import pytest

from dynatrain.devcluster import gobuild, goinstall

K8S_GO_MOD = gobuild.TOOLS / "k8s" / "go.mod"


# -- versions and go.mod ---------------------------------------------------------------------
@pytest.mark.parametrize("older, newer", [
    ("1.9", "1.21"), ("1.19.8", "1.21"), ("1.21", "1.26.0"), ("1.26.0", "1.26.8"),
    ("1.26.8", "1.26.10"), ("1.26.10", "1.27"), ("go1.26rc1", "go1.26.0"),
    ("1.26beta1", "1.26rc1"), ("1.26rc1", "1.26rc2"), ("1.26", "1.26beta1"), ("1.9.9", "1.10"),
])
def test_versions_compare_as_go_orders_them(older, newer):
    assert goinstall.version_key(older) < goinstall.version_key(newer)
    assert goinstall.version_key(newer) > goinstall.version_key(older)


def test_a_malformed_version_is_refused():
    with pytest.raises(goinstall.GoInstallError, match="not a Go version"):
        goinstall.version_key("1.26.x")


@pytest.mark.parametrize("go_mod, expected", [
    ("go 1.26.0\n", ("1.26.0", "1.26.0")),
    ("go 1.22 // language version\n", ("1.22", "1.22.0")),   # Go downloads 1.22.0 for it
    ("go 1.19\n", ("1.19", "1.19")),                           # before 1.21: named go1.19
    ("go 1.26.0\n\ntoolchain go1.26.8\n", ("1.26.0", "1.26.8")),
    ("go 1.26.0\ntoolchain go1.25.1\n", ("1.26.0", "1.26.0")),  # an older toolchain line
    ("go 1.26rc1\n", ("1.26rc1", "1.26rc1")),
])
def test_requirements_read_the_go_and_toolchain_lines(tmp_path, go_mod, expected):
    (tmp_path / "go.mod").write_text("module example.com/m\n\n" + go_mod)
    assert goinstall.requirements(tmp_path / "go.mod") == expected


def test_a_go_mod_without_a_go_line_is_refused(tmp_path):
    (tmp_path / "go.mod").write_text("module example.com/m\n// go 1.26.0 in a comment\n")
    with pytest.raises(goinstall.GoInstallError, match="has no `go` line"):
        goinstall.requirements(tmp_path / "go.mod")


def test_the_wrapper_modules_need_the_same_toolchain():
    # One download serves both builds; if they ever differ, two toolchains get installed.
    helm = goinstall.requirements(gobuild.TOOLS / "helm" / "go.mod")
    assert goinstall.requirements(K8S_GO_MOD)[1] == helm[1]


# -- the h1: hash ----------------------------------------------------------------------------
def _write_tiny_zip(path: Path) -> None:
    files = {
        "example.com/tiny@v1.0.0/go.mod": b"module example.com/tiny\n",
        "example.com/tiny@v1.0.0/a.txt": b"hello\n",
        "example.com/tiny@v1.0.0/Z.txt": b"upper case sorts first\n",
        "example.com/tiny@v1.0.0/sub/b.txt": b"",
        "example.com/tiny@v1.0.0/\u00e9t\u00e9.txt": "caf\u00e9\n".encode(),
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


def test_dirhash_of_a_hand_made_zip_is_gos(tmp_path):
    # The expected value is Go's: golang.org/x/mod/sumdb/dirhash.HashZip(zip, dirhash.Hash1)
    # (x/mod v0.32.0, go1.26.8) on this zip, written by this same function.
    _write_tiny_zip(tmp_path / "tiny.zip")
    assert goinstall.dirhash(tmp_path / "tiny.zip") == \
        "h1:vhXxQl3+J66yRXh9dgxo0XNxZ1T0IBG+QzpTSIO7A74="


def _go_for_tests() -> str:
    """go on PATH, else the one the installer provides (it is what the builder would use)."""
    try:
        return gobuild.go_command(K8S_GO_MOD)
    except gobuild.GoUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"no Go in CI: {exc}", pytrace=False)
        pytest.skip(str(exc))


def test_dirhash_matches_the_hashes_go_wrote_in_its_module_cache(tmp_path):
    go = _go_for_tests()
    env = {**os.environ, **goinstall.toolchain_env(go, gobuild.cache_root(
        "go", gobuild.GO_CACHE_ENV))}
    modcache = Path(subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True,
                                   check=True, env=env, cwd=tmp_path).stdout.strip())
    pairs = []
    for ziphash in sorted((modcache / "cache" / "download").rglob("*.ziphash")):
        zip_path = ziphash.with_suffix(".zip")
        if zip_path.is_file() and zip_path.stat().st_size < 30_000_000:
            pairs.append((zip_path, ziphash.read_text().strip()))
    if len(pairs) > 8:
        pairs = pairs[::len(pairs) // 8][:8]   # a spread of the cache, not its first 8
    if not pairs:
        # An empty module cache: have Go download a small module into a fresh one.
        out = subprocess.run([go, "mod", "download", "-json", "rsc.io/quote@v1.5.2"],
                             capture_output=True, text=True, cwd=tmp_path, check=True,
                             env={**env, "GOMODCACHE": str(tmp_path / "modcache"),
                                  "GOFLAGS": "-modcacherw"})
        info = json.loads(out.stdout)
        pairs = [(Path(info["Zip"]), info["Sum"])]
    for zip_path, go_hash in pairs:
        assert go_hash.startswith("h1:")
        assert goinstall.dirhash(zip_path) == go_hash, zip_path


# -- a real install --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_installs_the_toolchain_when_there_is_no_go_on_path(tmp_path, monkeypatch, request):
    """About 70 MB from the proxy; ``DYNATRAIN_GO_CACHE`` pointing at a cache saves that."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    if not os.environ.get(gobuild.GO_CACHE_ENV):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    # A GOROOT left over from another Go must not leak into the installed one.
    monkeypatch.setenv("GOROOT", str(tmp_path / "stale-goroot"))
    monkeypatch.setenv("GOCACHE", str(tmp_path / "gocache"))
    # 240 MB of toolchain and the build cache: not kept among pytest's last three tmp dirs.
    for kept in ("xdg", "gocache"):
        request.addfinalizer(lambda d=tmp_path / kept: shutil.rmtree(d, ignore_errors=True))
    cache = gobuild.cache_root("go", gobuild.GO_CACHE_ENV)
    wanted = goinstall.requirements(K8S_GO_MOD)[1]
    was_cached = (cache / f"go{wanted}" / "bin" / "go").is_file()

    logs: list[str] = []
    go = gobuild.go_command(K8S_GO_MOD, log=logs.append)
    assert Path(go) == cache / f"go{wanted}" / "bin" / "go"
    if not was_cached:
        assert len(logs) == 2 and "no go on PATH; downloading" in logs[0], logs
        assert f"/golang.org/toolchain/@v/v0.0.1-go{wanted}." in logs[0]
        assert " MB) from http" in logs[0]
        assert "verified (h1:" in logs[1], logs
    env = {**os.environ, **goinstall.toolchain_env(go, cache)}
    version = subprocess.run([go, "version"], capture_output=True, text=True, env=env,
                             check=True).stdout
    assert version.startswith(f"go version go{wanted} {goinstall.goos_goarch().replace('-', '/')}")

    # The builder finds it by itself (GoModule.go unset) and compiles and links with it.
    src = tmp_path / "hello"
    (src / "cmd" / "hello").mkdir(parents=True)
    (src / "go.mod").write_text(f"module example.com/hello\n\ngo {wanted}\n\n"
                                "tool example.com/hello/cmd/hello\n")
    (src / "go.sum").write_text("")
    (src / "cmd" / "hello" / "main.go").write_text(
        'package main\n\nimport "fmt"\n\n'
        'func main() { fmt.Println("built by the installed go") }\n')
    module = gobuild.GoModule(label="hello", module_dir=src, cache_root=tmp_path / "bin-cache",
                              binaries={"hello": "example.com/hello/cmd/hello"},
                              env={"CGO_ENABLED": "0"})
    built = gobuild.ensure_built(module, log=lambda _: None)
    out = subprocess.run([built.path("hello")], capture_output=True, text=True, check=True)
    assert out.stdout == "built by the installed go\n"


# -- a fake proxy ----------------------------------------------------------------------------
FAKE = "1.99.0"
"""A version no real cache holds, for the fake proxy's toolchain."""


class FakeProxy:
    """A module proxy on 127.0.0.1 serving one fake toolchain zip and its sumdb lookup."""

    def __init__(self, version: str = FAKE, *, wrong_hash: bool = False):
        self.version = version
        self.module_version = f"v0.0.1-go{version}.{goinstall.goos_goarch()}"
        self.zip = self._make_zip()
        h = self._h1(self.zip)
        self.hash = "h1:" + base64.b64encode(hashlib.sha256(b"other").digest()).decode() \
            if wrong_hash else h
        self.true_hash = h
        self.requests: list[str] = []
        self.files = {
            f"/golang.org/toolchain/@v/{self.module_version}.zip": self.zip,
            f"/sumdb/sum.golang.org/lookup/golang.org/toolchain@{self.module_version}": (
                f"12345\ngolang.org/toolchain {self.module_version} {self.hash}\n"
                f"golang.org/toolchain {self.module_version}/go.mod h1:AAAA=\n\n"
                "go.sum database tree\n1\nAAAA=\n\n\u2014 sum.golang.org sig\n").encode(),
        }
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                proxy.requests.append(self.path)
                body = proxy.files.get(self.path)
                self.send_response(200 if body is not None else 404)
                body = body if body is not None else b"not found"
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def _make_zip(self) -> bytes:
        prefix = f"golang.org/toolchain@{self.module_version}/"
        tool_dir = goinstall.goos_goarch().replace("-", "_")
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            # writestr(name, ...) stores mode 0600: bin/ and pkg/tool/ get their exec bits as
            # Go's own toolchain switch gives them; src/all.bash carries 0755 in the zip.
            z.writestr(prefix + "bin/go", f"#!/bin/sh\necho go version go{self.version} "
                       f"{goinstall.goos_goarch().replace('-', '/')}\n")
            z.writestr(prefix + f"pkg/tool/{tool_dir}/compile", "#!/bin/sh\n")
            z.writestr(prefix + "src/_go.mod", "module std\n")
            z.writestr(prefix + "VERSION", f"go{self.version}\n")
            info = zipfile.ZipInfo(prefix + "src/all.bash")
            info.external_attr = (stat.S_IFREG | 0o755) << 16
            z.writestr(info, "#!/bin/sh\n")
        return buf.getvalue()

    @staticmethod
    def _h1(data: bytes) -> str:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            lines = [f"{hashlib.sha256(z.read(n)).hexdigest()}  {n}\n"
                     for n in sorted(z.namelist())]
        return "h1:" + base64.b64encode(hashlib.sha256("".join(lines).encode()).digest()).decode()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def no_go(tmp_path, monkeypatch):
    """No go on PATH, a fresh toolchain cache, and no HTTP proxy between us and 127.0.0.1."""
    bin_dir = tmp_path / "path"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv(gobuild.GO_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    return bin_dir


@pytest.fixture
def go_mod(tmp_path):
    path = tmp_path / "mod" / "go.mod"
    path.parent.mkdir()
    path.write_text(f"module example.com/m\n\ngo {FAKE}\n")
    return path


@pytest.fixture
def fake_proxy(monkeypatch):
    proxies = []

    def start(**kwargs) -> FakeProxy:
        proxy = FakeProxy(**kwargs)
        proxies.append(proxy)
        monkeypatch.setenv("GOPROXY", f"{proxy.url},direct")
        return proxy

    yield start
    for proxy in proxies:
        proxy.close()


def _cache() -> Path:
    return gobuild.cache_root("go", gobuild.GO_CACHE_ENV)


def test_a_hash_mismatch_is_refused_naming_both_hashes(no_go, go_mod, fake_proxy):
    proxy = fake_proxy(wrong_hash=True)
    with pytest.raises(gobuild.GoBuildError) as info:
        gobuild.go_command(go_mod, log=lambda _: None)
    assert not isinstance(info.value, gobuild.GoUnavailable)   # not skipped as "no Go"
    message = str(info.value)
    assert proxy.true_hash in message and proxy.hash in message, message
    assert "does not match the checksum database" in message
    # Nothing is installed and nothing is left behind but the lock file.
    assert sorted(p.name for p in _cache().iterdir()) == [f".go{FAKE}.lock"]


def test_a_verified_toolchain_is_unpacked_with_exec_bits_and_reused(no_go, go_mod, fake_proxy):
    proxy = fake_proxy()
    logs: list[str] = []
    go = Path(gobuild.go_command(go_mod, log=logs.append))
    root = _cache() / f"go{FAKE}"
    assert go == root / "bin" / "go"
    assert len(logs) == 2 and f"downloading go{FAKE} (0 MB) from {proxy.url}/golang.org/" \
        f"toolchain/@v/{proxy.module_version}.zip" in logs[0], logs
    mode = {p.relative_to(root).as_posix(): p.stat().st_mode & 0o777
            for p in root.rglob("*") if p.is_file()}
    tool_dir = goinstall.goos_goarch().replace("-", "_")
    assert mode == {"bin/go": 0o755, f"pkg/tool/{tool_dir}/compile": 0o755,
                    "src/all.bash": 0o755, "src/_go.mod": 0o644, "src/go.mod": 0o644,
                    "VERSION": 0o644}
    assert (root / "src" / "go.mod").read_text() == "module std\n"   # as Go's switch does
    assert subprocess.run([go, "version"], capture_output=True, text=True).stdout.startswith(
        f"go version go{FAKE} ")
    # A GOROOT for the installed go, none for one found on PATH.
    assert goinstall.toolchain_env(str(go), _cache()) == {"GOROOT": str(root)}
    assert goinstall.toolchain_env("/usr/bin/go", _cache()) == {}
    # Cached: a later call (another process: no memo) asks the proxy nothing.
    downloads = len(proxy.requests)
    goinstall._found.clear()
    assert gobuild.go_command(go_mod, log=logs.append) == str(go)
    assert len(proxy.requests) == downloads and len(logs) == 2


def test_concurrent_installers_download_once(no_go, fake_proxy):
    proxy = fake_proxy()
    results, errors = [], []

    def install():
        try:
            results.append(goinstall.install(FAKE, _cache(), log=lambda _: None))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=install) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 3 and len(set(results)) == 1
    assert sum(p.endswith(".zip") for p in proxy.requests) == 1, proxy.requests


def test_a_newer_cached_toolchain_is_reused(no_go, tmp_path, fake_proxy):
    proxy = fake_proxy()
    installed = goinstall.install(FAKE, _cache(), log=lambda _: None)
    older = tmp_path / "older" / "go.mod"
    older.parent.mkdir()
    older.write_text("module example.com/older\n\ngo 1.22\n")
    assert gobuild.go_command(older) == str(installed)
    assert sum(p.endswith(".zip") for p in proxy.requests) == 1


# -- go on PATH ------------------------------------------------------------------------------
def _fake_go(bin_dir: Path, script: str) -> None:
    go = bin_dir / "go"
    go.write_text("#!/bin/sh\n" + script)
    go.chmod(0o755)


def test_go_on_path_older_than_1_21_is_replaced_by_an_install(no_go, go_mod, fake_proxy):
    fake_proxy()
    _fake_go(no_go, "echo go1.19.8\n")          # Debian bookworm's golang-go
    logs: list[str] = []
    go = gobuild.go_command(go_mod, log=logs.append)
    assert go == str(_cache() / f"go{FAKE}" / "bin" / "go")
    assert "is go1.19.8, older than 1.21, and cannot fetch" in logs[0], logs


def test_go_on_path_that_switches_toolchains_is_used(no_go, go_mod, fake_proxy, monkeypatch):
    proxy = fake_proxy()
    monkeypatch.delenv("GOTOOLCHAIN", raising=False)
    # Go 1.22 that fetches the go.mod's toolchain itself unless GOTOOLCHAIN=local.
    _fake_go(no_go, f'if [ "$GOTOOLCHAIN" = local ]; then echo go1.22.0; else echo go{FAKE}; fi\n')
    assert gobuild.go_command(go_mod) == str(no_go / "go")
    assert proxy.requests == []


def test_go_on_path_that_may_not_switch_is_replaced(no_go, go_mod, fake_proxy, monkeypatch):
    fake_proxy()
    monkeypatch.setenv("GOTOOLCHAIN", "local")
    # Go 1.22 under GOTOOLCHAIN=local: the go.mod's go line is an error in its directory.
    _fake_go(no_go, 'if [ -f go.mod ]; then echo "go: go.mod requires go >= 1.99.0" >&2; '
                    'exit 1; fi\necho go1.22.0\n')
    logs: list[str] = []
    go = gobuild.go_command(go_mod, log=logs.append)
    assert go == str(_cache() / f"go{FAKE}" / "bin" / "go")
    assert "is go1.22.0; asking it for go1.99.0" in logs[0], logs
    assert "does not switch to go1.99.0 (GOTOOLCHAIN=local)" in logs[1], logs


def test_go_on_path_that_is_new_enough_is_used(tmp_path):
    path_go = shutil.which("go")
    if path_go is None:
        pytest.skip("no go on PATH")
    minimum = goinstall.requirements(K8S_GO_MOD)[0]
    local = goinstall._go_version(path_go, cwd=tmp_path,
                                  env={**os.environ, "GOTOOLCHAIN": "local"})
    if goinstall.version_key(local) < goinstall.version_key(minimum):
        pytest.skip(f"go on PATH is go{local}, older than go{minimum}")
    assert goinstall.find_go(K8S_GO_MOD, tmp_path / "cache") == path_go
    assert not (tmp_path / "cache").exists()


# -- failed downloads ------------------------------------------------------------------------
def test_a_failed_download_is_go_unavailable_naming_the_url(no_go, go_mod, fake_proxy):
    proxy = fake_proxy(version="1.98.0")         # serves another version: 404 for ours
    with pytest.raises(gobuild.GoUnavailable) as info:
        gobuild.go_command(go_mod)
    message = str(info.value)
    assert f"{proxy.url}/sumdb/sum.golang.org/lookup/golang.org/toolchain@v0.0.1-go{FAKE}." \
        in message and "HTTP 404" in message, message
    assert "no go on PATH, and downloading" in message
    assert "set GOPROXY to a reachable module proxy, or install Go >= 1.21" in message


def test_an_unreachable_proxy_is_go_unavailable(no_go, go_mod, monkeypatch):
    monkeypatch.setenv("GOPROXY", "http://127.0.0.1:9")    # discard port: nothing listens
    with pytest.raises(gobuild.GoUnavailable, match=r"http://127\.0\.0\.1:9/sumdb/.*failed"):
        gobuild.go_command(go_mod)


def test_goproxy_without_an_http_proxy_is_go_unavailable(no_go, go_mod, monkeypatch):
    monkeypatch.setenv("GOPROXY", "direct")
    with pytest.raises(gobuild.GoUnavailable, match="GOPROXY='direct' names no http"):
        gobuild.go_command(go_mod)
