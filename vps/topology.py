"""Where devices run: the node of each device, as the switch planner and the mirrors see it.

Two decisions depend on which devices share a node. The planner's link costs
(:mod:`.timemodel`, :mod:`.planner`): a transfer between devices of one node runs over NVLink,
any other over a NIC. And the placement of mirrors (:mod:`dynatrain.trainer.redundancy`): a
rank's mirror must live on another node, so that losing a node never loses both copies. Both
read the same node map, :data:`Nodes`: on a cluster, device -> the node its pod really runs on
(the pods' ``spec.nodeName``, which the controller hands to every worker with each Prepare as
``device_nodes``); where that is not known, a number of devices per node, with devices packed
in order (node ``device // n``). Every rank of a switch is given the same map, so every rank
still derives the same plan and the same mirror pairs without talking.

Node ids are opaque: they are only compared for equality, used as keys, and (by the mirrors'
rotation) sorted; :func:`node_of` returns strings in both forms so that this is well defined.

Pure metadata: no torch import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Union

Nodes = Union[int, Mapping[int, str]]
DEFAULT_DEVICES_PER_NODE = 8
"""Devices per node where nothing says otherwise: an HGX/DGX server's eight GPUs. The one
default of the node map (a planner argument, a profile's field, a CLI flag's default)."""
"""Where devices run: devices per node (node = device // it), or device -> node name. A device
missing from a mapping counts as a node of its own."""


def node_of(nodes: Nodes, device: int) -> str:
    """The node of ``device`` under ``nodes`` (comparable with every other device's)."""
    if isinstance(nodes, int):
        # Zero-padded so that the order of node ids is the order of node numbers.
        return str(device // nodes).zfill(12)
    # The NUL prefix cannot be a Kubernetes node name: a missing device shares no node.
    return nodes.get(device, f"\x00device-{device}")


def check_nodes(nodes: Nodes, name: str, error: type[Exception] = ValueError) -> Nodes:
    """``nodes`` if it is a valid node map, else ``error`` with a message that names ``name``
    and the value: an ``int >= 1`` (``True`` is refused: it is a flag passed by mistake), or a
    mapping of int devices to non-empty string node names."""
    if isinstance(nodes, bool) or not isinstance(nodes, (int, Mapping)):
        raise error(f"{name}={nodes!r} must be a number of devices per node (an int >= 1) or a "
                    f"mapping of device to node name, not {type(nodes).__name__}")
    if isinstance(nodes, int):
        if nodes < 1:
            raise error(f"{name}={nodes} must be >= 1")
        return nodes
    for d, n in nodes.items():
        if isinstance(d, bool) or not isinstance(d, int) or not isinstance(n, str) or not n:
            raise error(f"{name} maps {d!r} to {n!r}: a node map takes int devices to "
                        "non-empty node names")
    return nodes


def node_table(nodes: Nodes, devices: Iterable[int], name: str = "devices_per_node",
               error: type[Exception] = ValueError) -> dict[int, str]:
    """``{device: node_of(nodes, device)}`` for ``devices``, once ``nodes`` is checked
    (:func:`check_nodes`): the lookup for the hot loops of the planner and the time model (a
    dict hit per transfer instead of a call)."""
    check_nodes(nodes, name, error)
    return {d: node_of(nodes, d) for d in devices}


__all__ = ["Nodes", "check_nodes", "node_of", "node_table"]
