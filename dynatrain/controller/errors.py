"""The errors the controller core raises to its front ends, and a layout's name in messages.

They are defined here, below :mod:`.core` and the modules it delegates to (:mod:`.recovery`,
:mod:`.adopt`, :mod:`.polling`), which all raise them; :mod:`.core` re-exports them, and the
front ends import them from there.
"""

from __future__ import annotations

from dynatrain.vps.layout import Layout


class JobFailed(RuntimeError):
    """The job cannot go on; the message says why and what was tried."""


class SuspendFailed(RuntimeError):
    """No checkpoint was written for a suspend; the message says why (the job trains on)."""


def layout_text(layout: Layout | None) -> str:
    return layout.to_text() if layout else "nothing"
