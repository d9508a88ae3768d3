#!/bin/sh
# Install Debian packages the tests need, once: `tools/install-debs.sh PACKAGE...`.
#
# Used by `make test` for Prometheus (tests/agent/test_metrics.py) and for the dev cluster's real
# node: containerd, runc, the CNI plugins and debootstrap (dynatrain/devcluster/kubelet.py,
# images.py). The tests start every daemon themselves, on their own ports and directories, so
# this script:
#   * does nothing for packages that are already installed (cheap in `make test`);
#   * installs the rest with apt-get, as root or through passwordless sudo;
#   * keeps the packages' maintainer scripts from starting their system services (Debian's
#     postinst runs `deb-systemd-invoke start ...`, or `invoke-rc.d` without systemd, which
#     would leave a prometheus on :9090 or a system containerd running). Both helpers ask
#     /usr/sbin/policy-rc.d first, and exit code 101 means "action forbidden", so a
#     policy-rc.d that exits 101 is put in place for the install (Docker's Debian images ship
#     one already; an existing file is left untouched).
#
# On a host booted with systemd the packages' services are still *enabled* and start at the
# next boot; `systemctl disable --now prometheus containerd` turns that off.
set -eu

if [ $# -eq 0 ]; then
    echo "usage: $0 PACKAGE..." >&2
    exit 2
fi

missing=""
for pkg in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $pkg"
    fi
done
if [ -z "$missing" ]; then
    echo "already installed: $*"
    exit 0
fi

# Root runs apt-get directly; anyone else needs sudo that does not prompt (make/CI have no tty).
if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "install-debs.sh: cannot install$missing: not root and no passwordless sudo." >&2
    echo "  Install them yourself: apt-get install$missing" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-debs.sh: apt-get not found; this script supports Debian/Ubuntu only." >&2
    echo "  Install the equivalents of:$missing" >&2
    exit 1
fi

POLICY=/usr/sbin/policy-rc.d
created_policy=""
cleanup() {
    if [ -n "$created_policy" ]; then
        $SUDO rm -f "$POLICY"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
if [ ! -e "$POLICY" ]; then
    # 101 = "action forbidden by policy": invoke-rc.d and deb-systemd-invoke skip the start.
    printf '#!/bin/sh\n# Temporary, from DynaTrain tools/install-debs.sh\nexit 101\n' \
        | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod 755 "$POLICY"
    created_policy=1
fi

# sudo resets the environment, so the variable is passed through env(1). noninteractive keeps
# debconf from asking questions; --no-install-recommends keeps out what the tests do not use
# (prometheus-node-exporter, which would be started as well).
echo "installing:$missing"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
# shellcheck disable=SC2086  # one word per package
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
