import os

# Threads that wait at an OpenMP barrier sleep rather than spin (libgomp, torch's OpenMP
# runtime, reads this once, when torch is first imported: here, before any test imports it;
# every process a test starts inherits it: ranks, fork servers, `dynatrain run`, workers, the
# operator). The test machine is oversubscribed on purpose (two pytest sessions and their
# workers on 2 cores), and a process with more than one torch thread there (run_local's single
# rank, which takes every core; the pytest process's own torch) spins at every barrier while
# its other thread waits for a core: on 2 cores with both busy, run_local of gpt-tiny at dp=1
# for 24 steps took 28.4 core-s spinning and 8.8 sleeping (tests/controller/test_data_events,
# once 222 s of a CI run). A harness setting for the tests' machine, not the product's: on an
# idle machine spinning saves a wake-up per barrier, and users' processes keep torch's default
# (tests/test_conftest.py checks that the setting reaches what the tests start).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from hypothesis import HealthCheck, settings  # noqa: E402

# CI runs more examples than a developer's quick loop; both are deterministic per seed.
settings.register_profile("ci", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], derandomize=True)
settings.register_profile("dev", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_runtest_setup(item):
    # `gpu` tests need CUDA; elsewhere (CI, laptops) they are skipped, saying why. torch is
    # imported only for them, so sessions without one do not pay for it here.
    if item.get_closest_marker("gpu") is not None:
        import pytest
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs CUDA: torch.cuda.is_available() is False")
