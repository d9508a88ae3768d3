"""Waiting for CustomResourceDefinitions to be served.

``kubectl wait --for=condition=Established`` is not enough right after an apply: until the
apiserver's CRD controller has written the first condition, ``.status.conditions`` is null
and kubectl fails at once ("accessor error: <nil> is of the type <nil>") instead of waiting.
That race failed a CI run. Here the conditions are read through the API and a missing list
counts as "not yet".
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

from kubernetes import client

from .processes import wait_until


def established(extensions: client.ApiextensionsV1Api, name: str) -> bool:
    """Whether the CRD ``name`` has the condition Established=True (False while it has none)."""
    status = extensions.read_custom_resource_definition(name).status
    return any(c.type == "Established" and c.status == "True"
               for c in (status.conditions if status else None) or [])


def wait_established(api: client.ApiClient, names: Iterable[str], *,
                     timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> None:
    """Until the apiserver serves every CRD of ``names``; DevClusterError naming them if not
    within ``timeout``."""
    extensions = client.ApiextensionsV1Api(api)
    names = list(names)
    wait_until(f"CRDs {names} to be established",
               lambda: all(established(extensions, n) for n in names), timeout=timeout)
