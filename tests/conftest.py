import os

from hypothesis import HealthCheck, settings

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
