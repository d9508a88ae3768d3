#!/bin/sh
# Install a real Prometheus server (Debian's `prometheus` package) for the metrics tests.
#
# The tests in tests/test_metrics.py start the `prometheus` binary themselves, on a free port
# with a temporary data directory, and scrape DynaTrain's /metrics endpoint. They only need the
# binary, never the system service, so this script:
#   * does nothing when `prometheus` is already installed (idempotent, cheap in `make test`);
#   * installs the package with apt-get, as root or through passwordless sudo;
#   * keeps the package's maintainer scripts from starting the prometheus daemon: Debian's
#     postinst runs `deb-systemd-invoke start prometheus.service` (or `invoke-rc.d` without
#     systemd), which would leave a server listening on :9090 in a container or CI runner.
#     Both helpers ask /usr/sbin/policy-rc.d first, and exit code 101 means "action forbidden",
#     so a policy-rc.d that exits 101 is put in place for the duration of the install (Docker's
#     Debian images ship one already; an existing file is left untouched).
#
# Note: on a host booted with systemd the package still *enables* prometheus.service, so it
# will start at the next boot; `systemctl disable --now prometheus` turns that off.
set -eu

print_version() {
    # `prometheus --version` prints several lines (version, build user, go version ...).
    "$1" --version 2>&1 | head -n 1
}

existing=$(command -v prometheus 2>/dev/null || true)
if [ -z "$existing" ] && [ -x /usr/bin/prometheus ]; then
    existing=/usr/bin/prometheus
fi
if [ -n "$existing" ]; then
    echo "prometheus already installed: $existing"
    print_version "$existing"
    exit 0
fi

# Root runs apt-get directly; anyone else needs sudo that does not prompt (make/CI have no tty).
if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "install-prometheus.sh: cannot install the 'prometheus' package: not root and no" >&2
    echo "  passwordless sudo. Install it yourself (apt-get install prometheus), or put a" >&2
    echo "  Prometheus 2.x 'prometheus' binary on PATH." >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-prometheus.sh: apt-get not found; this script supports Debian/Ubuntu only." >&2
    echo "  Put a Prometheus 2.x 'prometheus' binary on PATH instead." >&2
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
    printf '#!/bin/sh\n# Temporary, from DynaTrain tools/install-prometheus.sh\nexit 101\n' \
        | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod 755 "$POLICY"
    created_policy=1
fi

# sudo resets the environment, so the variable is passed through env(1). noninteractive keeps
# debconf from asking questions; --no-install-recommends skips prometheus-node-exporter, which
# would otherwise be installed (and started) as well.
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus

print_version /usr/bin/prometheus
