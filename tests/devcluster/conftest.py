"""Fixtures shared by the Go builder's tests (test_gobuild.py, test_gopins.py)."""

from __future__ import annotations

import os

import pytest

from dynatrain.devcluster import gobuild


@pytest.fixture(scope="module")
def go():
    """A Go for the control plane's go.mod; skip (fail in CI) if there is none and none can be
    installed."""
    try:
        return gobuild.go_command(gobuild.TOOLS / "k8s" / "go.mod")
    except gobuild.GoUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"no Go toolchain: CI builds the control plane with it: {exc}",
                        pytrace=False)
        pytest.skip(f"no Go toolchain to build with: {exc}")
