"""Where a recovery restores from, as pure choices over the members' Status (no processes):
:func:`dynatrain.controller.decide.previous_restore`. The runs that reach these choices are in
test_overlap.py and test_recovery.py."""

from __future__ import annotations


from dynatrain.agent.v1 import agent_pb2 as pb
from dynatrain.controller import decide
from dynatrain.vps.layout import parse_layout
from dynatrain.vps.presets import PRESETS

State = pb.StatusResponse.State
OLD = parse_layout("dp=1,tp=1,pp=2").with_devices([0, 1])
GROWN = parse_layout("dp=1,tp=1,pp=3").with_devices([0, 2, 1])


def previous_restore(new, holdings):
    return decide.previous_restore(PRESETS["gpt-tiny"], new, holdings, lambda *layouts: 8)


def _switched(device: int) -> pb.StatusResponse:
    """A member that completed the switch OLD -> GROWN and keeps OLD's snapshots."""
    return pb.StatusResponse(
        state=State.INTERRUPTED, device=device, generation=2, layout=GROWN.to_text(),
        devices=list(GROWN.device_of), snapshot_steps=[4], previous_generation=1,
        previous_layout=OLD.to_text(), previous_devices=list(OLD.device_of),
        previous_snapshot_steps=[3, 4], previous_mirror_of=-1, mirror_of=-1)


def test_a_member_whose_switch_failed_still_holds_the_previous_generation():
    # pp=2 -> pp=3 with joiner 2, which died as its part of the switch ended: member 1
    # completed the switch (it keeps OLD's snapshots as "previous"); member 0's switch failed
    # in the mirror exchange with the joiner, so it still runs OLD with its snapshots as its
    # own. Together they hold OLD whole at step 4: restore there, in memory.
    failed_switch = pb.StatusResponse(
        state=State.INTERRUPTED, device=0, generation=1, layout=OLD.to_text(),
        devices=list(OLD.device_of), snapshot_steps=[3, 4], mirror_of=-1,
        previous_mirror_of=-1)
    holdings = {0: failed_switch, 1: _switched(1)}
    found = previous_restore(OLD, holdings)
    assert found is not None
    start, dead, (step, proxies) = found
    assert start.to_text() == OLD.to_text() and list(start.device_of) == [0, 1]
    assert dead == () and step == 4 and proxies == {}


def test_without_the_members_own_copy_there_is_no_previous_restore():
    # The same, but member 0 is gone: OLD's first stage survives nowhere in memory.
    assert previous_restore(parse_layout("dp=1").with_devices([1]),
                            {1: _switched(1)}) is None


def test_a_member_of_another_generation_does_not_count():
    # Member 0 reports OLD's layout but a generation other than the kept one: not a copy of it.
    other = pb.StatusResponse(
        state=State.INTERRUPTED, device=0, generation=3, layout=OLD.to_text(),
        devices=list(OLD.device_of), snapshot_steps=[4], mirror_of=-1, previous_mirror_of=-1)
    assert previous_restore(OLD, {0: other, 1: _switched(1)}) is None
