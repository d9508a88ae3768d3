"""The errors the ``dynatrain`` console script reports as one line on stderr with exit code 2.

:class:`UsageError` is raised by the command modules for a bad command-line value;
:data:`USER_ERRORS` are the library's own validation errors (bad model, bad layout, impossible
plan, bad job or scenario). This module imports no command module, so every command can import it.
"""

from __future__ import annotations

from dynatrain.spec.job import JobError
from dynatrain.controller.scenario import ScenarioError
from dynatrain.trainer.config import ConfigError
from dynatrain.trainer.schedule import ScheduleError
from dynatrain.vps.layout import LayoutError
from dynatrain.vps.model import ModelSpecError
from dynatrain.vps.planner import PlanError

USER_ERRORS = (LayoutError, ModelSpecError, PlanError, ConfigError, JobError, ScenarioError,
               ScheduleError)


class UsageError(ValueError):
    """A command-line value is not valid; the message names it and what would be."""
