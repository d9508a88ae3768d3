#!/bin/sh
# A real Prometheus server (Debian's `prometheus` package) for the metrics tests, which start
# the binary themselves on a free port (tests/agent/test_metrics.py). An existing `prometheus` on
# PATH is used as it is.
set -eu
existing=$(command -v prometheus 2>/dev/null || true)
if [ -z "$existing" ]; then
    "$(dirname "$0")/install-debs.sh" prometheus
    existing=/usr/bin/prometheus
fi
# `prometheus --version` prints several lines (version, build user, go version ...).
echo "prometheus: $existing, $("$existing" --version 2>&1 | head -n 1)"
