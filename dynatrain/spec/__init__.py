"""What a job is, for every layer that runs one: the job spec and its parser (:mod:`.job`), the
device profiles (:mod:`.hardware`) and the timeouts (:mod:`.timeouts`).

These sit below the agent and the controller and above the trainer (DESIGN's arrows, as the
import-linter layers in pyproject.toml): the worker reads the same spec, profiles and timeouts as
the controller that drives it, and neither may import the other to get them (#32)."""
