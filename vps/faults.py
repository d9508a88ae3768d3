"""Deterministic failure injection, for the tests and ``dynatrain bench chaos``.

``DYNATRAIN_FAULT="device:D,at:POINT[,round:R][,skip:N][,mode:M]"`` makes device D fail at a
named point of its work, like ``kill -9`` (mode ``exit``, the default) or by never answering
again (mode ``hang``):

- ``at:round`` (the default; with ``round:R``): on reaching network round R of a transfer;
- ``at:transfer``: as a switch's transfer starts;
- ``at:prepare``: inside the background preparation of a generation;
- ``at:step``: before each training step (``skip:N`` lets N steps pass; with ``mode:hang``
  the training thread stops while the agent still answers Status: the watchdog's other case);
- ``at:switched``: once a switch built this device's trainer of the new generation, before
  its first snapshot (a member that just joined dies holding state no one mirrors yet).

``device:-1`` (:data:`CONTROLLER`) is the controller itself (the operator, or the local
runner), which has two points of its own, for tests of a controller that dies mid-switch:

- ``at:prepared``: every device of a switch has prepared it, before any Commit is sent;
- ``at:committed``: every device holds the switch's Commit (it completes without us).

``skip:N`` lets the first N arrivals at the point pass (e.g. the job's first generation is a
preparation too). With ``DYNATRAIN_FAULT_LOG=FILE`` the device appends one JSON line (device,
point, wall time) before it fails, so a benchmark can time recovery from the fault itself.
Without the variable these calls cost one dictionary lookup.

``DYNATRAIN_SLOWDOWN="device:D,factor:F"`` makes device D compute F times slower than it does
(:func:`slowdown`; the trainer sleeps ``F - 1`` times each step's own compute time, outside
any collective): a straggler or a slower device on one machine, for the measured-cost and
rebalancing tests and ``benchmarks/rebalance.py``.
"""

from __future__ import annotations

import json
import os
import time

_arrivals: dict[str, int] = {}
CONTROLLER = -1
"""The device id that names the controller in ``DYNATRAIN_FAULT``."""


def armed(point: str, device: int) -> bool:
    """Whether ``DYNATRAIN_FAULT`` names this point and device (so a caller may prepare it:
    e.g. wait until the moment it describes has come)."""
    spec = os.environ.get("DYNATRAIN_FAULT")
    if not spec:
        return False
    fields = dict(part.split(":", 1) for part in spec.split(","))
    return int(fields.get("device", -2)) == device and fields.get("at", "round") == point


def inject(point: str, device: int, round_index: int | None = None) -> None:
    spec = os.environ.get("DYNATRAIN_FAULT")
    if not spec:
        return
    fields = dict(part.split(":", 1) for part in spec.split(","))
    if int(fields.get("device", -1)) != device or fields.get("at", "round") != point:
        return
    if point == "round" and int(fields.get("round", 0)) != round_index:
        return
    _arrivals[point] = _arrivals.get(point, 0) + 1
    if _arrivals[point] <= int(fields.get("skip", 0)):
        return
    log = os.environ.get("DYNATRAIN_FAULT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"device": device, "point": point, "time": time.time()}) + "\n")
    if fields.get("mode", "exit") == "hang":
        while True:
            time.sleep(3600)
    os._exit(17)


def slowdown(device: int) -> float:
    """The compute slowdown ``DYNATRAIN_SLOWDOWN`` gives ``device`` (1.0: none); a malformed
    value is a ``ValueError`` that names it and the expected form."""
    spec = os.environ.get("DYNATRAIN_SLOWDOWN")
    if not spec:
        return 1.0
    try:
        fields = dict(part.split(":", 1) for part in spec.split(","))
        target, factor = int(fields["device"]), float(fields["factor"])
    except (KeyError, ValueError):
        raise ValueError(f"DYNATRAIN_SLOWDOWN={spec!r} is not 'device:D,factor:F' (e.g. "
                         "'device:1,factor:2.5')") from None
    if not factor >= 1.0:
        raise ValueError(f"DYNATRAIN_SLOWDOWN={spec!r}: factor {factor} must be >= 1")
    return factor if target == device else 1.0
