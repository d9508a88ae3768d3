"""A ``DynaTrainJob`` manifest read into a :class:`JobSpec`, with every problem named at once.

The same YAML runs on a cluster (the operator receives it from the apiserver, which has already
applied the CRD's schema) and on one machine (``dynatrain run JOB.yaml``, where nothing checked
it before). So this module checks everything the controller relies on itself and reports each
problem with its field path (``spec.elastic.maxWorkers``), the value, and what would be valid.

Fields the local runner does not use (``image``, ``command``, ``resources.cpu`` ...) are read
and kept, so a manifest written for the cluster needs no edits to run locally.

The typed field reader and the readers of the sub-sections (``spec.agent.issuerRef``,
``spec.model.hf``, ``spec.training.data``, ``spec.training.lrSchedule``,
``spec.recovery.timeouts`` with its ``TIMEOUT_FIELDS``, ``spec.recovery.resumeFrom``) live in
:mod:`.sections`; ``spec.checkpoint.path`` is read here, beside the paths it must keep clear.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from dynatrain.trainer.config import PRECISIONS, DataSource
from dynatrain.trainer.schedule import LRSchedule
from dynatrain.vps.layout import Layout, LayoutError, micro_batch_shares, parse_layout
from dynatrain.vps.model import ModelSpec, ModelSpecError, model_from_dict
from dynatrain.vps.presets import load_model

from .sections import (TIMEOUT_FIELDS, _data, _hf_model, _issuer_ref, _Reader, _resume_from,
                       _schedule, _timeouts)
from .timeouts import Timeouts

API_VERSION = "dynatrain.io/v1alpha1"
KIND = "DynaTrainJob"
PREEMPTION_POLICIES = ("Switch", "Ignore")
DEFAULT_GLOBAL_BATCH_SIZE = 8
"""``spec.globalBatchSize`` when unset (the CRD's schema default too)."""
WORKER_METRICS_PORT = 9400
"""The port the worker serves its metrics on (``operator/cluster.py`` ``METRICS_PORT``): the
agent cannot have it."""
WORKER_HEALTH_PORT = 9401
"""The port the worker serves its health service alone on, in plaintext, for the kubelet's
probe (``operator/cluster.py`` ``HEALTH_PORT``): the agent cannot have it either."""
MIN_AGENT_PORT = 1024
"""The worker runs as a non-root user (UID 10001), which cannot bind a lower port."""
OPERATOR_MOUNTS = {"/etc/dynatrain": "the job file", "/var/run/secrets": "the agent token"}
"""What the operator mounts in every worker, and where (``operator/cluster.py``)."""
SYSTEM_DIRS = ("/proc", "/sys", "/dev", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib64",
               "/boot", "/run", "/var/run")
"""Directories of the worker container that a checkpoint claim must not be mounted over."""


class JobError(ValueError):
    """A job manifest cannot run; the message names every problem with its field."""


@dataclass(frozen=True)
class Training:
    steps: int = 100
    seq_len: int = 0
    micro_batch_size: int = 1
    learning_rate: float = 1e-3
    adam_eps: float = 1e-8
    seed: int = 0
    data: str = "synthetic"
    data_dtype: str = "uint16"
    tokenizer: str = ""
    data_format: str = "auto"
    data_blend: tuple[DataSource, ...] = ()
    """``spec.training.data`` as a list (or ``sources``): the blend; ``data`` is then unused."""
    shuffle: bool = False
    shuffle_seed: int | None = None
    lr_schedule: LRSchedule = LRSchedule()
    grad_clip: float = 0.0
    init_hf: str = ""
    """``spec.model.hf``: the checkpoint directory whose weights start the job."""
    activation_checkpointing: bool = False
    """``spec.training.activationCheckpointing``: recompute each block in the backward pass."""

    @property
    def sources(self) -> tuple[DataSource, ...]:
        return self.data_blend or (DataSource(path=self.data, format=self.data_format),)


@dataclass(frozen=True)
class Limits:
    """Bounds on the layouts the solver may pick in auto mode (None: no bound)."""

    max_tp: int | None = None
    max_pp: int | None = None
    max_ep: int | None = None
    zero_stages: tuple[int, ...] = (0, 1, 3)

    def allow(self, layout: Layout) -> bool:
        return ((self.max_tp is None or layout.tp <= self.max_tp)
                and (self.max_pp is None or layout.pp <= self.max_pp)
                and (self.max_ep is None or layout.ep <= self.max_ep)
                and layout.zero in self.zero_stages)


@dataclass(frozen=True)
class Rebalance:
    """``spec.parallelism.rebalance``: move layers between pipeline stages, live, when the
    measured stages are uneven (:func:`dynatrain.controller.decide.rebalance`), and relieve
    the job of a straggler (:mod:`dynatrain.controller.straggler`)."""

    enabled: bool = False
    threshold: float = 1.15
    """Act when the slowest stage's measured compute is this many times the mean stage's."""
    payback_steps: int = 50
    """Only if the modelled saving pays the switch's own cost back within this many steps."""
    shares: bool = True
    """A straggler may get fewer micro-batches (uneven data-parallel shares). False keeps the
    shares even, so the job trains bit-identically to a run without rebalancing (uneven
    shares sum the ranks' gradients in another order); it is then left out or kept."""


@dataclass(frozen=True)
class RecoverySpec:
    """How the job survives workers that die without notice (``spec.recovery``)."""

    mirror: bool = True
    """Mirror each worker's unique state (no replica across DP) to a buddy's host memory
    after every step, so that one lost worker (or node) costs no checkpoint."""
    snapshot_every: int = 1
    """Steps between in-memory snapshots (``spec.recovery.snapshotEverySteps``): a recovery
    then trains up to ``snapshot_every - 1`` steps again, and the snapshots' copy and mirror
    cost that much less per step. ``dynatrain plan --memory`` prints the smallest value that
    keeps the modelled cost at or under 5% of a step."""
    checkpoint_interval: int = 0
    """Steps between PyTorch Distributed Checkpoints (``spec.checkpoint.intervalSteps``), the
    last resort; 0: no ``spec.checkpoint``, none."""
    checkpoint_dir: str = ""
    """Where the workers write them (``spec.checkpoint.path``, the claim's mount point on a
    cluster); ``dynatrain run`` uses ``<run dir>/checkpoints`` instead."""
    checkpoint_keep: int = 2
    resume_from: str = ""
    """Start the job from this checkpoint (written under any layout). With ``spec.checkpoint``
    it lies under ``checkpoint_dir`` (the claim's mount: workers load checkpoints from there
    only): an absolute path under it, or a path relative to it, kept relative here
    (``other-job/step-00000120``) so that each worker resolves it against its own mount."""
    timeouts: tuple[tuple[str, float], ...] = ()
    """``spec.recovery.timeouts`` as (field, seconds), the hierarchy of
    :class:`~dynatrain.controller.orchestrator.Timeouts` (unset fields keep its defaults)."""

    def timeouts_config(self):
        return Timeouts(**{TIMEOUT_FIELDS[k]: v for k, v in self.timeouts})


@dataclass(frozen=True)
class JobSpec:
    name: str
    namespace: str
    model: ModelSpec
    model_ref: dict
    """The manifest's ``spec.model`` as written (a preset name or an inline spec)."""
    min_workers: int
    max_workers: int
    workers: int | None
    """Desired workers (the scale subresource); None: as many as capacity allows."""
    mode: str
    """``auto`` (the solver picks) or ``fixed``."""
    layout: Layout | None
    global_batch_size: int
    training: Training
    gpus_per_worker: int = 0
    agent_port: int = 50051
    auth_secret: str | None = None
    issuer_ref: dict | None = None
    """``spec.agent.issuerRef`` with its defaults ({name, kind, group}): cert-manager issues
    the agents' certificates; None: the operator's own per-job CAs."""
    preemption_policy: str = "Switch"
    image: str = ""
    min_efficiency: float = 0.0
    """``spec.elastic.minEfficiency``: a worker is kept only while it adds at least this
    fraction of a worker's throughput (0: every worker capacity allows;
    :meth:`dynatrain.controller.policy.Policy.efficient_workers`)."""
    limits: Limits = Limits()
    rebalance: Rebalance = Rebalance()
    recovery: RecoverySpec = RecoverySpec()
    save_hf: str = ""
    """``spec.output.hf``: where the workers write a Hugging Face checkpoint of the trained
    model when the job completes; empty: none."""
    tensorboard: str = ""
    """``spec.output.tensorboard``: the directory the job's rank 0 writes TensorBoard event
    files to; empty: ``<checkpoint path>/<job>/tensorboard`` when the job has a checkpoint
    volume, else none (:meth:`tensorboard_dir`)."""
    log_every: int = 10
    """``spec.output.logEverySteps``: the job's rank 0 logs a step line every this many steps
    (switches and recoveries always)."""
    suspend: bool = False
    """``spec.suspend``: the operator checkpoints the job to its claim and removes its pods;
    set back to false, the job continues from that checkpoint under whatever layout fits."""
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    def tensorboard_dir(self, checkpoint_dir: str = "") -> str:
        """Where the job's TensorBoard event files go: ``spec.output.tensorboard``, else the
        job's folder on its checkpoint volume (``checkpoint_dir``, default the spec's), else
        empty (none written)."""
        if self.tensorboard:
            return self.tensorboard
        root = checkpoint_dir or self.recovery.checkpoint_dir
        return str(Path(root) / self.name / "tensorboard") if root else ""

    def train_config(self, layout: Layout):
        """The trainer's config for this job under ``layout``."""
        from dynatrain.trainer.config import TrainConfig

        t = self.training
        return TrainConfig(model=self.model, layout=layout,
                           global_batch_size=self.global_batch_size,
                           micro_batch_size=t.micro_batch_size, seq_len=t.seq_len,
                           lr=t.learning_rate, eps=t.adam_eps, seed=t.seed, data=t.data,
                           data_dtype=t.data_dtype, tokenizer=t.tokenizer,
                           data_format=t.data_format, data_blend=t.data_blend,
                           shuffle=t.shuffle, shuffle_seed=t.shuffle_seed,
                           lr_schedule=t.lr_schedule, total_steps=t.steps,
                           grad_clip=t.grad_clip, init_hf=t.init_hf,
                           activation_checkpointing=t.activation_checkpointing)


def job_from_manifest(doc: Any, *, source: str = "manifest") -> JobSpec:
    """A :class:`JobSpec` from a parsed manifest; :class:`JobError` names every problem."""
    if not isinstance(doc, dict):
        raise JobError(f"{source}: expected a {KIND} object, got {type(doc).__name__}")
    r = _Reader()
    if doc.get("apiVersion") != API_VERSION:
        r.problems.append(f"apiVersion={doc.get('apiVersion')!r} must be {API_VERSION!r}")
    if doc.get("kind") != KIND:
        r.problems.append(f"kind={doc.get('kind')!r} must be {KIND!r}")
    meta = r.obj(doc, "metadata", "", required=True)
    name = r.str(meta, "name", "metadata", required=True) or "job"
    namespace = r.str(meta, "namespace", "metadata", "default") or "default"
    spec = r.obj(doc, "spec", "", required=True)
    image = r.str(spec, "image", "spec", "") if "image" in spec else ""

    model_ref = r.obj(spec, "model", "spec", required=True)
    model = None
    hf_dir = ""
    if model_ref:
        if sum(k in model_ref for k in ("preset", "spec", "hf")) != 1:
            r.problems.append("spec.model: set exactly one of spec.model.preset, "
                              "spec.model.spec and spec.model.hf")
        elif "hf" in model_ref:
            hf_dir = r.str(model_ref, "hf", "spec.model") or ""
            model = _hf_model(r, hf_dir, model_ref.get("hfConfig")) if hf_dir else None
        elif "preset" in model_ref:
            preset = r.str(model_ref, "preset", "spec.model")
            if preset:
                try:
                    model = load_model(preset)
                except ModelSpecError as e:
                    r.problems.append(f"spec.model.preset: {e}")
        else:
            try:
                model = model_from_dict(model_ref["spec"], source="spec.model.spec")
            except (ModelSpecError, TypeError) as e:
                r.problems.append(f"spec.model.spec: {e}")

    elastic = r.obj(spec, "elastic", "spec", required=True)
    min_w = r.int(elastic, "minWorkers", "spec.elastic", minimum=1, required=True)
    max_w = r.int(elastic, "maxWorkers", "spec.elastic", minimum=1, required=True)
    workers = r.int(elastic, "workers", "spec.elastic", minimum=0)
    if min_w and max_w and min_w > max_w:
        r.problems.append(f"spec.elastic.minWorkers={min_w} must be <= "
                          f"spec.elastic.maxWorkers={max_w}")
    min_eff = r.float(elastic, "minEfficiency", "spec.elastic", 0.0, positive=False)
    if min_eff is not None and not 0.0 <= min_eff < 1.0:
        r.problems.append(f"spec.elastic.minEfficiency={min_eff!r} must be in [0, 1) (the "
                          "fraction of a worker's throughput an added worker must bring)")
        min_eff = 0.0
    if workers is not None and min_w and max_w and not min_w <= workers <= max_w:
        r.problems.append(f"spec.elastic.workers={workers} must lie in "
                          f"[minWorkers, maxWorkers] = [{min_w}, {max_w}]")

    par = r.obj(spec, "parallelism", "spec")
    mode = r.str(par, "mode", "spec.parallelism", "auto", choices=("auto", "fixed")) or "auto"
    layout = None
    if "layout" in par:
        try:
            layout = parse_layout(par["layout"])
        except LayoutError as e:
            r.problems.append(f"spec.parallelism.layout: {e}")
    elif mode == "fixed":
        r.problems.append("spec.parallelism.layout is required when spec.parallelism.mode "
                          "is fixed")

    lim = r.obj(par, "limits", "spec.parallelism")
    zero = lim.get("zeroStages", [0, 1, 3])
    if not isinstance(zero, list) or not zero or any(z not in (0, 1, 3) for z in zero):
        r.problems.append(f"spec.parallelism.limits.zeroStages={zero!r} must be a non-empty "
                          "list of 0, 1, 3")
        zero = [0, 1, 3]
    limits = Limits(max_tp=r.int(lim, "maxTP", "spec.parallelism.limits", minimum=1),
                    max_pp=r.int(lim, "maxPP", "spec.parallelism.limits", minimum=1),
                    max_ep=r.int(lim, "maxEP", "spec.parallelism.limits", minimum=1),
                    zero_stages=tuple(sorted(set(zero))))
    reb = r.obj(par, "rebalance", "spec.parallelism")
    threshold = r.float(reb, "threshold", "spec.parallelism.rebalance", Rebalance.threshold)
    if threshold is not None and threshold <= 1.0:
        r.problems.append(f"spec.parallelism.rebalance.threshold={threshold!r} must be > 1 "
                          "(the slowest stage over the mean stage; 1.0 is even)")
    if reb.get("enabled") is True and mode == "fixed":
        r.problems.append("spec.parallelism.rebalance applies only to mode auto (a fixed job "
                          "keeps spec.parallelism.layout, stages included)")
    rebalance = Rebalance(
        enabled=r.bool(reb, "enabled", "spec.parallelism.rebalance", False),
        threshold=threshold or Rebalance.threshold,
        payback_steps=r.int(reb, "paybackSteps", "spec.parallelism.rebalance",
                            Rebalance.payback_steps, minimum=1) or Rebalance.payback_steps,
        shares=r.bool(reb, "shares", "spec.parallelism.rebalance", True))
    gbs = (r.int(spec, "globalBatchSize", "spec", DEFAULT_GLOBAL_BATCH_SIZE, minimum=1)
           or DEFAULT_GLOBAL_BATCH_SIZE)
    tr = r.obj(spec, "training", "spec")
    precision = r.str(tr, "precision", "spec.training", choices=tuple(PRECISIONS))
    if model is not None and precision:
        model = replace(model, dtype=PRECISIONS[precision])
    data = _data(r, tr)
    checkpointing = r.bool(tr, "activationCheckpointing", "spec.training", False)
    training = Training(
        steps=r.int(tr, "steps", "spec.training", 100, minimum=1) or 100,
        seq_len=r.int(tr, "seqLen", "spec.training", 0, minimum=0) or 0,
        micro_batch_size=r.int(tr, "microBatchSize", "spec.training", 1, minimum=1) or 1,
        learning_rate=r.float(tr, "learningRate", "spec.training", 1e-3),
        adam_eps=r.float(tr, "adamEpsilon", "spec.training", 1e-8),
        seed=r.int(tr, "seed", "spec.training", 0, minimum=0) or 0,
        **data,
        lr_schedule=_schedule(r, r.obj(tr, "lrSchedule", "spec.training")),
        grad_clip=(r.float(tr, "gradClip", "spec.training", 0.0, positive=False)
                   if "gradClip" in tr else 0.0),
        init_hf=hf_dir, activation_checkpointing=checkpointing)
    if training.grad_clip < 0:
        r.problems.append(f"spec.training.gradClip={training.grad_clip} must be >= 0 "
                          "(0: no clipping)")
    if training.lr_schedule.min_lr > training.learning_rate:
        r.problems.append(f"spec.training.lrSchedule.minLearningRate="
                          f"{training.lr_schedule.min_lr} exceeds spec.training.learningRate="
                          f"{training.learning_rate}")
    if (model is not None and training.data_dtype == "uint16" and model.vocab_size > 1 << 16
            and any(s.kind in ("tokens", "table") for s in training.sources)):
        # (text and SFT: the tokenizer's vocabulary decides the cached file's dtype)
        r.problems.append(f"spec.training.data.dtype='uint16' cannot hold the ids of the "
                          f"model's {model.vocab_size:,}-token vocabulary; use 'uint32'")
    mbs = training.micro_batch_size
    gbs_text = (f"spec.globalBatchSize={gbs}" if "globalBatchSize" in spec
                else f"spec.globalBatchSize={gbs} (the default)")
    if gbs % mbs:
        r.problems.append(f"{gbs_text} must be a multiple of spec.training.microBatchSize="
                          f"{mbs}: every step is a whole number of micro-batches")
    res = r.obj(spec, "resources", "spec")
    gpus = r.int(res, "gpus", "spec.resources", 0, minimum=0) or 0
    agent = r.obj(spec, "agent", "spec")
    port = r.int(agent, "port", "spec.agent", 50051)
    if (not MIN_AGENT_PORT <= port <= 65535
            or port in (WORKER_METRICS_PORT, WORKER_HEALTH_PORT)):
        r.problems.append(f"spec.agent.port={port} cannot be used: valid ports are "
                          f"{MIN_AGENT_PORT}..65535 except {WORKER_METRICS_PORT} and "
                          f"{WORKER_HEALTH_PORT} (the worker runs as a non-root user, which "
                          f"cannot bind a port below {MIN_AGENT_PORT}, serves its metrics on "
                          f"{WORKER_METRICS_PORT} and its health probe on {WORKER_HEALTH_PORT})")
        port = 50051
    secret = r.str(agent, "authSecret", "spec.agent")
    issuer_ref = _issuer_ref(r, agent.get("issuerRef")) if agent else None
    policy = r.str(spec, "preemptionPolicy", "spec", "Switch",
                   choices=PREEMPTION_POLICIES) or "Switch"

    output = r.obj(spec, "output", "spec")
    save_hf = r.str(output, "hf", "spec.output") or "" if output else ""
    tensorboard = r.str(output, "tensorboard", "spec.output") or "" if output else ""
    log_every = (r.int(output, "logEverySteps", "spec.output", 10, minimum=1) or 10
                 if output else 10)

    rec = r.obj(spec, "recovery", "spec")
    mirror = r.bool(rec, "mirror", "spec.recovery", True)
    ck = r.obj(spec, "checkpoint", "spec")
    r.str(ck, "claimName", "spec.checkpoint")          # the cluster's volume; checked only
    ck_path = _checkpoint_path(r, ck) if ck else ""
    if ck and (name.startswith(".") or any(c in name for c in "/\\\x00")):
        # The job's checkpoints go in <root>/<name> (trainer.checkpoint.job_checkpoint_dir).
        r.problems.append(f"metadata.name={name!r} cannot name the job's checkpoint folder "
                          "under spec.checkpoint.path: use a Kubernetes object name (no '/', "
                          "no leading '.')")
    recovery = RecoverySpec(
        timeouts=_timeouts(r, r.obj(rec, "timeouts", "spec.recovery")),
        mirror=mirror,
        snapshot_every=r.int(rec, "snapshotEverySteps", "spec.recovery", 1, minimum=1,
                             maximum=1000) or 1,
        checkpoint_interval=(r.int(ck, "intervalSteps", "spec.checkpoint", 1000, minimum=1)
                             or 1000) if ck else 0,
        checkpoint_dir=ck_path,
        checkpoint_keep=r.int(ck, "keep", "spec.checkpoint", 2, minimum=1) or 2,
        resume_from=_resume_from(r, r.str(rec, "resumeFrom", "spec.recovery") or "", ck_path))

    if model is not None and layout is not None:
        from dynatrain.vps.layout import layout_problems

        bad = layout_problems(layout, model)
        if bad:
            r.problems.append(f"spec.parallelism.layout={layout.to_text()!r} does not fit "
                              f"{model.name}: " + "; ".join(bad))
    if layout is not None and mode == "fixed":
        # The only layout a fixed job runs (auto mode does not use it: the solver picks).
        if max_w and layout.world > max_w:
            r.problems.append(f"spec.parallelism.layout={par['layout']!r} (mode fixed) needs "
                              f"dp*tp*pp = {layout.world} workers, more than "
                              f"spec.elastic.maxWorkers={max_w}: raise maxWorkers or choose a "
                              f"layout with at most {max_w} workers")
        if gbs % mbs == 0:
            try:
                micro_batch_shares(layout, gbs, mbs)
            except LayoutError as e:
                r.problems.append(f"spec.parallelism.layout={par['layout']!r} (mode fixed) "
                                  f"cannot split {gbs_text} by "
                                  f"spec.training.microBatchSize={mbs}: {e}")
    suspend = r.bool(spec, "suspend", "spec", False)
    if model is not None and training.seq_len > model.max_seq_len:
        r.problems.append(f"spec.training.seqLen={training.seq_len} exceeds the model's "
                          f"max_seq_len {model.max_seq_len}")
    if r.problems:
        raise JobError(f"{source}: " + "; ".join(r.problems))
    return JobSpec(name=name, namespace=namespace, model=model, model_ref=model_ref,
                   min_workers=min_w, max_workers=max_w, workers=workers, mode=mode,
                   min_efficiency=min_eff or 0.0,
                   layout=layout, global_batch_size=gbs, training=training,
                   gpus_per_worker=gpus, agent_port=port, auth_secret=secret,
                   issuer_ref=issuer_ref,
                   preemption_policy=policy, image=image or "", raw=doc, limits=limits,
                   rebalance=rebalance,
                   recovery=recovery, save_hf=save_hf, tensorboard=tensorboard,
                   log_every=log_every, suspend=suspend)


def _checkpoint_path(r: _Reader, ck: dict) -> str:
    """``spec.checkpoint.path``, where the claim is mounted in each worker: the CRD's two rules."""
    path = ck.get("path", "/checkpoints")
    if not isinstance(path, str) or not path:
        r.str(ck, "path", "spec.checkpoint")           # reports it
        return "/checkpoints"
    # One trailing slash changes nothing (/proc/ is /proc); any other empty, '.' or '..'
    # segment would let a path walk around the directories below (/checkpoints/../etc).
    norm = path[:-1] if len(path) > 1 and path.endswith("/") else path
    if path != "/" and (not path.startswith("/") or ":" in path
                        or any(p in ("", ".", "..") for p in norm.split("/")[1:])):
        r.problems.append(f"spec.checkpoint.path={path!r} must be an absolute path without ':' "
                          "and without '.', '..' or empty segments, e.g. /checkpoints")
        return path
    hit = [d for d in (*OPERATOR_MOUNTS, *SYSTEM_DIRS) if norm == d or norm.startswith(d + "/")]
    if path == "/":
        why = "over the whole file system of the worker container"
    elif hit and hit[0] in OPERATOR_MOUNTS:
        why = f"at or under {hit[0]}, where the operator mounts {OPERATOR_MOUNTS[hit[0]]}"
    elif hit:
        why = f"at or under {hit[0]}, a system directory the worker needs"
    else:
        return path
    r.problems.append(f"spec.checkpoint.path={path!r} would mount the checkpoint claim {why}: "
                      "use a directory of its own, e.g. /checkpoints")
    return path


def load_job(path: str | Path) -> JobSpec:
    """Read a job manifest file (YAML; the first document that is a DynaTrainJob)."""
    path = Path(path)
    if not path.is_file():
        raise JobError(f"job manifest {str(path)!r} does not exist")
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as e:
        raise JobError(f"{path}: not valid YAML: {e}") from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if not jobs:
        raise JobError(f"{path}: holds no {KIND} (kinds found: "
                       f"{[d.get('kind') for d in docs if isinstance(d, dict)]})")
    return job_from_manifest(jobs[0], source=str(path))
