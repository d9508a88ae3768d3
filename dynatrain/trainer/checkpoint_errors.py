"""The errors of reading and writing checkpoints, apart from both.

:mod:`.checkpoint` (imported by every worker) and :mod:`.dcp_planners` (which imports DCP, and
which :mod:`.checkpoint` imports only when it saves or loads) both raise them; defining them
here keeps either from importing the other at module level. :mod:`.checkpoint` re-exports them.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or read: a collective save failed (the message names the
    rank(s) and the reason), or a checkpoint's files are not what we write."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds something that loading it would execute or read outside it (a
    pickled global beyond DCP's metadata classes, a ``BytesIO`` item, a data file outside the
    checkpoint directory); the message names the file and what was refused."""


class CheckpointPathError(ValueError):
    """A checkpoint path outside every directory this process may read checkpoints from."""
