import os

from hypothesis import HealthCheck, settings

# CI runs more examples than a developer's quick loop; both are deterministic per seed.
settings.register_profile("ci", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], derandomize=True)
settings.register_profile("dev", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")
