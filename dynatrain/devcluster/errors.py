"""The one exception type of the dev cluster.

Every failure the dev cluster can detect (a build that fails, a process that
exits early, a wait that times out) is raised as :class:`DevClusterError`
with a message that names what failed, the value involved and the log file
to read, so a red CI run says where to look without re-running it.
"""


class DevClusterError(RuntimeError):
    """A dev-cluster component failed to build, start, become ready or stop."""
