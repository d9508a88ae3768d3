"""What the operator refuses to do on a job's behalf: the checks against a confused deputy.

Whoever may create a ``DynaTrainJob`` gets the operator to act for them with the operator's
own rights: to run an image with a Secret mounted, in their namespace. Two things here keep
that to what the cluster's owner allowed:

- **the agents' token Secret** (``spec.agent.authSecret``) is used only if it carries the
  label :data:`AGENT_TOKEN_LABEL` ``= "true"``. Without the label a job could name any Secret
  of its namespace (another workload's database password, a registry credential) and have
  the operator mount it into pods running an image of the job's choosing. Labelling a Secret
  is a deliberate act by someone who may edit it. The Secret the operator creates for a job
  that names none carries the label too;
- **the image** (``spec.image``) must start with one of the operator's ``--allowed-images``
  prefixes (the chart's ``allowedImages``); an empty list allows any image. The image is
  matched as written in the spec (no registry or tag is filled in), and a prefix matches only
  at a boundary of the reference: ``registry.example.com/team`` admits
  ``registry.example.com/team/trainer:1`` and ``registry.example.com/team:1``, never
  ``registry.example.com/team-evil/x``. ``spec.command`` and ``spec.args`` only choose what
  runs *inside* that image, and nothing else in a job's spec names an image (no init
  containers, no sidecars), so checking ``spec.image`` covers every container the operator
  creates.

Also the parsers of the operator's flags for these checks and for the NetworkPolicies
(:mod:`.netpol`): image prefixes, and ``key=value`` label lists. Every check is a pure function
that returns "" when all is well and otherwise the message the job's condition and Event carry.
"""

from __future__ import annotations

import re

AGENT_TOKEN_LABEL = "dynatrain.io/agent-token"
"""A Secret the operator may use as a job's agent token carries this label, value "true"."""

_BOUNDARY = "/:@"
"""Characters after which an image reference's next part starts (path, tag, digest)."""
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def label_command(namespace: str, name: str) -> str:
    return f"kubectl label secret {name} -n {namespace} {AGENT_TOKEN_LABEL}=true"


def check_auth_secret(secret, namespace: str) -> str:
    """"" if the Secret (a client model object) may serve as a job's agent token; else why
    not, naming the Secret, the label and the command that adds it."""
    name = secret.metadata.name
    labels = secret.metadata.labels or {}
    if labels.get(AGENT_TOKEN_LABEL) == "true":
        return ""
    has = (f"its label {AGENT_TOKEN_LABEL} is {labels[AGENT_TOKEN_LABEL]!r}, not \"true\""
           if AGENT_TOKEN_LABEL in labels else f"it lacks the label {AGENT_TOKEN_LABEL}=true")
    return (f"spec.agent.authSecret names Secret {namespace}/{name}, but {has}: the operator "
            "mounts into worker pods only Secrets labelled for that, so that a job cannot "
            "borrow another workload's Secret. If this Secret holds only the agents' token, "
            f"label it ({label_command(namespace, name)}) and create the job again")


def image_allowed(image: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``image`` starts with one of ``prefixes`` at a reference boundary (an empty
    tuple allows every image)."""
    if not prefixes:
        return True
    for p in prefixes:
        if image == p:
            return True
        if image.startswith(p) and (p[-1] in _BOUNDARY or image[len(p)] in _BOUNDARY):
            return True
    return False


def check_image(image: str, prefixes: tuple[str, ...]) -> str:
    """"" if the job's image is allowed; else a message naming it and the allowed prefixes."""
    if image_allowed(image, prefixes):
        return ""
    return (f"spec.image {image!r} is not allowed by this operator: images must start with "
            f"one of {', '.join(repr(p) for p in prefixes)} (the chart's allowedImages, "
            "flag --allowed-images); no worker pod is created. spec.image cannot change on a "
            "job: create the job again with an allowed image, or have the operator's admin "
            "add a prefix")


def parse_image_prefixes(text: str) -> tuple[str, ...]:
    """``PREFIX[,PREFIX...]`` -> the prefixes; "" -> () (any image). A prefix with white
    space, or an empty one between commas, is an error naming it."""
    if not text.strip():
        return ()
    out = []
    for i, raw in enumerate(text.split(",")):
        p = raw.strip()
        if not p or any(c.isspace() for c in p):
            raise ValueError(f"--allowed-images: item {i + 1} ({raw!r}) is not an image "
                             "prefix (e.g. registry.example.com/team/); separate prefixes "
                             "with commas, no spaces")
        out.append(p)
    return tuple(out)


def parse_labels(text: str, flag: str) -> dict[str, str]:
    """``key=value[,key=value...]`` -> a dict of Kubernetes labels; "" -> {}. A malformed
    item is an error naming the flag, the item and the expected form."""
    out: dict[str, str] = {}
    if not text.strip():
        return out
    for raw in text.split(","):
        key, eq, value = raw.strip().partition("=")
        if not eq or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
            raise ValueError(f"{flag}: {raw!r} is not key=value with a Kubernetes label key "
                             "and value (e.g. kubernetes.io/metadata.name=monitoring); "
                             "separate items with commas")
        out[key] = value
    return out


def format_labels(labels: dict[str, str]) -> str:
    """The inverse of :func:`parse_labels` (the flags' form)."""
    return ",".join(f"{k}={v}" for k, v in labels.items())
