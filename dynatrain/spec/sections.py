"""The per-section readers of a ``DynaTrainJob`` manifest, used by :mod:`.job`.

:class:`_Reader` reads typed fields out of the manifest's nested mappings and collects every
problem instead of raising; the functions below read one sub-section each
(``spec.agent.issuerRef``, ``spec.model.hf``, ``spec.training.data``,
``spec.training.lrSchedule``, ``spec.recovery.timeouts``, ``spec.recovery.resumeFrom``) into
the values :func:`.job.job_from_manifest` builds the :class:`.job.JobSpec` from. They report
each problem with its field path, the value, and what would be valid; :mod:`.job` raises
:class:`.job.JobError` with all of them at once.
"""

from __future__ import annotations

from pathlib import Path

from dynatrain.trainer.config import DATA_FORMATS, TOKEN_DTYPES, DataSource, data_format
from dynatrain.trainer.schedule import DECAYS, LRSchedule, ScheduleError
from dynatrain.vps.model import ModelSpec, ModelSpecError

from .timeouts import Timeouts

ISSUER_KINDS = ("Issuer", "ClusterIssuer")
TIMEOUT_FIELDS = {"statusSeconds": "status_s", "watchdogSeconds": "watchdog_s",
                  "collectiveSeconds": "group_s", "prepareSeconds": "prepare_s",
                  "commitSeconds": "commit_s", "giveUpSeconds": "give_up_s"}
"""``spec.recovery.timeouts`` fields, shortest first: each must be shorter than the next."""


class _Reader:
    """Reads typed fields out of nested dicts and collects problems instead of raising."""

    def __init__(self):
        self.problems: list[str] = []

    def obj(self, parent: dict, key: str, path: str, required: bool = False) -> dict:
        value = parent.get(key)
        if value is None:
            if required:
                self.problems.append(f"{path}.{key} is required")
            return {}
        if not isinstance(value, dict):
            self.problems.append(f"{path}.{key} must be a mapping, got {value!r}")
            return {}
        return value

    def bool(self, parent: dict, key: str, path: str, default: bool) -> bool:
        value = parent.get(key, default)
        if not isinstance(value, bool):
            self.problems.append(f"{path}.{key}={value!r} must be true or false")
            return default
        return value

    def int(self, parent: dict, key: str, path: str, default=None, *, minimum: int | None = None,
            maximum: int | None = None, required: bool = False):
        value = parent.get(key, default)
        if value is None:
            if required:
                self.problems.append(f"{path}.{key} is required")
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            self.problems.append(f"{path}.{key}={value!r} must be an integer")
            return default
        if minimum is not None and value < minimum or maximum is not None and value > maximum:
            rng = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
            self.problems.append(f"{path}.{key}={value} must be {rng}")
            return default
        return value

    def float(self, parent: dict, key: str, path: str, default: float, *, positive=True):
        value = parent.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.problems.append(f"{path}.{key}={value!r} must be a number")
            return default
        if positive and not value > 0:
            self.problems.append(f"{path}.{key}={value} must be positive")
            return default
        return float(value)

    def str(self, parent: dict, key: str, path: str, default=None, *, choices=None,
            required: bool = False):
        value = parent.get(key, default)
        if value is None:
            if required:
                self.problems.append(f"{path}.{key} is required")
            return None
        if not isinstance(value, str) or not value:
            self.problems.append(f"{path}.{key}={value!r} must be a non-empty string")
            return default
        if choices and value not in choices:
            self.problems.append(f"{path}.{key}={value!r} is not one of {', '.join(choices)}")
            return default
        return value


def _issuer_ref(r: _Reader, ref) -> dict | None:
    """``spec.agent.issuerRef``: {name, kind (Issuer or ClusterIssuer), group} with kind
    defaulting to Issuer and group to cert-manager.io (the CRD's defaults)."""
    if ref is None:
        return None
    if not isinstance(ref, dict):
        r.problems.append(f"spec.agent.issuerRef={ref!r} must be an object with name, kind, "
                          "group")
        return None
    unknown = sorted(set(ref) - {"name", "kind", "group"})
    if unknown:
        r.problems.append(f"spec.agent.issuerRef: unknown field(s) {', '.join(unknown)}; "
                          "valid fields: name, kind, group")
    name = r.str(ref, "name", "spec.agent.issuerRef", required=True)
    kind = r.str(ref, "kind", "spec.agent.issuerRef", "Issuer", choices=ISSUER_KINDS)
    group = r.str(ref, "group", "spec.agent.issuerRef", "cert-manager.io")
    if not name:
        return None
    return {"name": name, "kind": kind or "Issuer", "group": group or "cert-manager.io"}


def _hf_model(r: _Reader, hf_dir: str, inline) -> ModelSpec | None:
    """``spec.model.hf``: the spec from ``spec.model.hfConfig`` when given (the operator cannot
    read a directory on the workers' volume), else from the directory's ``config.json``."""
    from dynatrain.vps.hf import model_from_hf, model_from_hf_config

    try:
        if inline is None:
            return model_from_hf(hf_dir)
        if not isinstance(inline, dict):
            r.problems.append(f"spec.model.hfConfig must be a mapping (the checkpoint's "
                              f"config.json), got {type(inline).__name__}")
            return None
        return model_from_hf_config(inline, name=Path(hf_dir).name or "hf",
                                    source="spec.model.hfConfig")
    except ModelSpecError as e:
        where = "spec.model.hfConfig" if inline is not None else "spec.model.hf"
        hint = ("" if inline is not None or Path(hf_dir).is_dir() else
                " (on a cluster the operator cannot read the workers' volume: inline the "
                "checkpoint's config.json as spec.model.hfConfig; `dynatrain hf-config DIR` "
                "prints it)")
        r.problems.append(f"{where}: {e}{hint}")
        return None


DATA_FIELDS = ("path", "sources", "dtype", "tokenizer", "format", "shuffle", "seed")
SOURCE_FIELDS = ("path", "weight", "format")


def _data(r: _Reader, tr: dict) -> dict:
    """``spec.training.data``: ``synthetic``, a path, a list of sources ``[{path, weight,
    format}, ...]`` (a blend), or a mapping ``{path | sources, dtype, tokenizer, format,
    shuffle, seed}``. Returns the ``Training`` fields."""
    at = "spec.training.data"
    value = tr.get("data", "synthetic")
    if isinstance(value, str) and value:
        return dict(data=value)
    if isinstance(value, list):
        value = {"sources": value}
    if not isinstance(value, dict):
        r.problems.append(f"{at}={value!r} must be 'synthetic', a path, a list of sources "
                          "[{path, weight, format}], or a mapping {path or sources, dtype, "
                          "tokenizer, format, shuffle, seed}")
        return {}
    unknown = sorted(set(value) - set(DATA_FIELDS))
    if unknown:
        r.problems.append(f"{at}: unknown field(s) {', '.join(unknown)}; valid fields: "
                          f"{', '.join(DATA_FIELDS)}")
    out = dict(data_dtype=r.str(value, "dtype", at, "uint16", choices=tuple(TOKEN_DTYPES))
               or "uint16",
               tokenizer=(r.str(value, "tokenizer", at, "") if "tokenizer" in value else "")
               or "")
    out["shuffle"] = r.bool(value, "shuffle", at, False)
    if "seed" in value:
        out["shuffle_seed"] = r.int(value, "seed", at, 0, minimum=0)
    fmt = r.str(value, "format", at, "auto", choices=DATA_FORMATS) or "auto"
    if ("path" in value) == ("sources" in value):
        r.problems.append(f"{at} needs exactly one of path (one source) and sources (a blend)")
        return out
    if "path" in value:
        out["data"] = r.str(value, "path", at, required=True) or "synthetic"
        out["data_format"] = fmt
        sources = [DataSource(path=out["data"], format=fmt)]
        where = [f"{at}.path"]
    else:
        items = value["sources"]
        if "format" in value:
            r.problems.append(f"{at}.format applies to one path; give each source its own "
                              "format")
        if not isinstance(items, list) or not items:
            r.problems.append(f"{at}.sources={items!r} must be a non-empty list of "
                              "{path, weight, format}")
            return out
        sources, where = [], []
        for n, item in enumerate(items):
            here = f"{at}.sources[{n}]" if "sources" in tr.get("data", {}) else f"{at}[{n}]"
            if isinstance(item, str):
                item = {"path": item}
            if not isinstance(item, dict):
                r.problems.append(f"{here}={item!r} must be a mapping {{path, weight, format}}")
                continue
            bad = sorted(set(item) - set(SOURCE_FIELDS))
            if bad:
                r.problems.append(f"{here}: unknown field(s) {', '.join(bad)}; valid fields: "
                                  f"{', '.join(SOURCE_FIELDS)} (tokenizer, dtype and shuffle "
                                  f"go on {at} itself)")
            path = r.str(item, "path", here, required=True)
            weight = r.float(item, "weight", here, 1.0)
            f = r.str(item, "format", here, "auto", choices=DATA_FORMATS) or "auto"
            if path:
                sources.append(DataSource(path=path, weight=weight or 1.0, format=f))
                where.append(here)
        if len(sources) == 1:
            out["data"], out["data_format"] = sources[0].path, sources[0].format
        else:
            out["data_blend"] = tuple(sources)
    for s, here in zip(sources, where):
        kind = data_format(s.path, s.format)
        if kind in ("text", "sft") and not out["tokenizer"]:
            r.problems.append(f"{here}={s.path!r} is {kind}; set {at}.tokenizer to a Hugging "
                              "Face tokenizer directory")
    return out


def _schedule(r: _Reader, doc: dict) -> LRSchedule:
    """``spec.training.lrSchedule``: {warmupSteps, decay, decaySteps, minLearningRate}."""
    if not doc:
        return LRSchedule()
    unknown = sorted(set(doc) - {"warmupSteps", "decay", "decaySteps", "minLearningRate"})
    if unknown:
        r.problems.append(f"spec.training.lrSchedule: unknown field(s) {', '.join(unknown)}; "
                          "valid fields: warmupSteps, decay, decaySteps, minLearningRate")
    path = "spec.training.lrSchedule"
    try:
        return LRSchedule(
            warmup_steps=r.int(doc, "warmupSteps", path, 0, minimum=0) or 0,
            decay=r.str(doc, "decay", path, "constant", choices=DECAYS) or "constant",
            decay_steps=r.int(doc, "decaySteps", path, 0, minimum=0) or 0,
            min_lr=r.float(doc, "minLearningRate", path, 0.0, positive=False))
    except ScheduleError as e:
        r.problems.append(f"{path}: {e}")
        return LRSchedule()


def _timeouts(r: _Reader, doc: dict) -> tuple[tuple[str, float], ...]:
    """``spec.recovery.timeouts``: known fields, positive, in the order of the hierarchy."""
    unknown = sorted(set(doc) - set(TIMEOUT_FIELDS))
    if unknown:
        r.problems.append(f"spec.recovery.timeouts: unknown fields {unknown}; valid: "
                          f"{', '.join(TIMEOUT_FIELDS)}")
    defaults = Timeouts()
    out = tuple((k, r.float(doc, k, "spec.recovery.timeouts", getattr(defaults, attr)))
                for k, attr in TIMEOUT_FIELDS.items() if k in doc)
    chain = [(k, dict(out).get(k, getattr(defaults, attr))) for k, attr in TIMEOUT_FIELDS.items()]
    for (a, x), (b, y) in zip(chain, chain[1:]):
        if a == "collectiveSeconds" and b == "prepareSeconds":
            ok = x <= y           # a Prepare builds groups: it may wait as long as one
        else:
            ok = x < y
        if not ok:
            r.problems.append(f"spec.recovery.timeouts.{a}={x:g} must be "
                              f"{'at most' if a == 'collectiveSeconds' else 'less than'} "
                              f"{b}={y:g}: the hierarchy is statusSeconds < "
                              "watchdogSeconds < collectiveSeconds <= prepareSeconds < "
                              "commitSeconds < giveUpSeconds")
    return out


def _resume_from(r: _Reader, resume: str, root: str) -> str:
    """``spec.recovery.resumeFrom``: on a job with a checkpoint claim, a checkpoint under the
    claim's mount ``root`` (absolute, or relative to it); a worker loads nothing else."""
    if not resume or not root:
        return resume
    parts = resume.strip("/").split("/")
    if "\x00" in resume or any(p in ("", ".", "..") for p in parts):
        r.problems.append(f"spec.recovery.resumeFrom={resume!r} must name a checkpoint under "
                          f"spec.checkpoint.path={root!r} without '.', '..' or empty segments "
                          "(absolute, or relative to that path, e.g. other-job/step-00000120)")
        return resume
    if resume.startswith("/") and root != "/" and not (
            resume.rstrip("/") == root.rstrip("/") or resume.startswith(root.rstrip("/") + "/")):
        r.problems.append(f"spec.recovery.resumeFrom={resume!r} is outside "
                          f"spec.checkpoint.path={root!r}: workers load checkpoints only from "
                          "the job's checkpoint claim; copy the checkpoint onto the claim, or "
                          "give a path relative to spec.checkpoint.path")
    return resume
