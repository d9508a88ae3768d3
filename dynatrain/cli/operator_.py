"""``dynatrain operator``: run the Kubernetes operator (kopf) for DynaTrainJob objects.

The module is named ``operator_`` so that it can never shadow the standard library's
``operator``; the handlers themselves live in ``dynatrain.operator``.
"""

from __future__ import annotations

import argparse
import os


def register(sub) -> None:
    p = sub.add_parser(
        "operator", help="run the Kubernetes operator for DynaTrainJob objects",
        description="Watch DynaTrainJob objects and run each job: worker pods, the best "
        "layout for the GPUs at hand, live switches off preempted nodes and onto new ones. "
        "Uses the in-cluster service account, or KUBECONFIG / --kubeconfig outside a cluster.")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then "
                   "$KUBECONFIG / ~/.kube/config)")
    p.add_argument("--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable; default: all)")
    p.add_argument("--liveness", metavar="URL", default=None,
                   help="serve a health endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus port")
    p.add_argument("--rendezvous-host", default=None,
                   help="address the workers reach this operator at (default $POD_IP)")
    p.add_argument("--standalone", action="store_true",
                   help="no leader election: act even if other operators run (one replica)")
    p.add_argument("--leader-lease", default="dynatrain-operator", metavar="NAME",
                   help="the coordination.k8s.io Lease the replicas elect a leader on: "
                   "exactly one acts, the others stand by (default dynatrain-operator)")
    p.add_argument("--lease-namespace", default=None, metavar="NS",
                   help="namespace of the Lease (default $POD_NAMESPACE, else the first "
                   "--namespace, else default)")
    p.add_argument("--lease-seconds", type=int, default=10, metavar="N",
                   help="a leader that stops renewing is replaced after N seconds; one that "
                   "stops cleanly at once (default 10, at least 3)")
    p.add_argument("--max-pods-per-job", type=int, default=256, metavar="N",
                   help="no job gets more worker pods than N, whatever its maxWorkers "
                   "(default 256)")
    p.add_argument("--gang-wait", type=float, default=60.0, metavar="SECONDS",
                   help="a job that has not started and holds part of its minWorkers while its "
                   "other pods wait (for a node, or for Kueue's quota) lets go of what it "
                   "holds after SECONDS, and tries again later, so that it never keeps GPUs "
                   "others could use while it cannot run (default 60)")
    p.add_argument("--worker-cpu", default="1", metavar="QUANTITY",
                   help="CPU request and limit of workers whose job sets no "
                   "spec.resources.cpu (default 1)")
    p.add_argument("--worker-memory", default="4Gi", metavar="QUANTITY",
                   help="memory request and limit of workers whose job sets no "
                   "spec.resources.memory (default 4Gi)")
    p.add_argument("--cert-lifetime", default="30d", metavar="DURATION",
                   help="lifetime of each job's agent serving certificate and the operator's "
                   "client certificate (mutual TLS to the agents), e.g. 30d, 12h, 90m, or "
                   "seconds; each is renewed, without stopping the job, when a third of it "
                   "is left. The job's CAs live a year (at least three lifetimes). With "
                   "spec.agent.issuerRef it is the Certificates' duration (cert-manager's "
                   "minimum, 1h, at least) (default 30d)")
    p.add_argument("--allowed-images", default="", metavar="PREFIX[,PREFIX]",
                   help="run only jobs whose spec.image starts with one of these prefixes "
                   "(e.g. registry.example.com/team/); others get the ImageAllowed=False "
                   "condition and no pod (default: any image)")
    p.add_argument("--network-policy", action=argparse.BooleanOptionalAction, default=True,
                   help="create a NetworkPolicy per job: only the job's pods and the "
                   "operator's reach its workers, the metrics port from "
                   "--metrics-namespace-selector (default on)")
    p.add_argument("--operator-namespace", default=None, metavar="NS",
                   help="the namespace of the operator's pods, which the job policies admit "
                   "to the agents (default $POD_NAMESPACE, else default)")
    p.add_argument("--operator-pod-labels", default=None, metavar="KEY=VALUE[,KEY=VALUE]",
                   help="labels of the operator's pods, which the job policies admit to the "
                   "agents (default: the chart's, app.kubernetes.io/name=dynatrain,"
                   "app.kubernetes.io/component=operator)")
    p.add_argument("--metrics-namespace-selector", default="", metavar="KEY=VALUE[,KEY=VALUE]",
                   help="labels of the namespaces whose pods may scrape the workers' metrics "
                   "port, e.g. kubernetes.io/metadata.name=monitoring (default: every "
                   "namespace)")
    p.set_defaults(func=run_operator)


def run_operator(args) -> int:
    import kopf
    from kubernetes.utils import parse_quantity

    if args.gang_wait <= 0:
        raise SystemExit(f"dynatrain operator: --gang-wait={args.gang_wait:g} must be more than "
                         "0 seconds")
    if args.max_pods_per_job < 1:
        raise SystemExit(f"dynatrain operator: --max-pods-per-job={args.max_pods_per_job} "
                         "must be at least 1")
    for flag, value in (("--worker-cpu", args.worker_cpu),
                        ("--worker-memory", args.worker_memory)):
        try:
            if parse_quantity(value) <= 0:
                raise ValueError
        except ValueError:
            raise SystemExit(f"dynatrain operator: {flag}={value!r} is not a positive "
                             "Kubernetes quantity (e.g. 500m or 2 for CPU, 4Gi for memory)")
    from dynatrain.operator import guard

    try:        # refused here, with the flag's name, rather than in every job's pass
        guard.parse_image_prefixes(args.allowed_images)
        guard.parse_labels(args.metrics_namespace_selector, "--metrics-namespace-selector")
        if args.operator_pod_labels is not None and not guard.parse_labels(
                args.operator_pod_labels, "--operator-pod-labels"):
            raise ValueError("--operator-pod-labels: empty; the job policies would admit "
                             "every pod of the operator's namespace to the agents")
    except ValueError as e:
        raise SystemExit(f"dynatrain operator: {e}")
    os.environ["DYNATRAIN_ALLOWED_IMAGES"] = args.allowed_images
    os.environ["DYNATRAIN_NETWORK_POLICY"] = "1" if args.network_policy else "0"
    os.environ["DYNATRAIN_METRICS_NAMESPACE_SELECTOR"] = args.metrics_namespace_selector
    if args.operator_namespace:
        os.environ["DYNATRAIN_OPERATOR_NAMESPACE"] = args.operator_namespace
    if args.operator_pod_labels is not None:
        os.environ["DYNATRAIN_OPERATOR_POD_LABELS"] = args.operator_pod_labels
    from dynatrain.operator.pki import parse_duration

    try:
        os.environ["DYNATRAIN_CERT_LIFETIME_S"] = str(parse_duration(args.cert_lifetime))
    except ValueError as e:
        raise SystemExit(f"dynatrain operator: --cert-lifetime: {e}")
    os.environ["DYNATRAIN_MAX_PODS_PER_JOB"] = str(args.max_pods_per_job)
    os.environ["DYNATRAIN_GANG_WAIT_S"] = str(args.gang_wait)
    os.environ["DYNATRAIN_WORKER_CPU"] = args.worker_cpu
    os.environ["DYNATRAIN_WORKER_MEMORY"] = args.worker_memory
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig
    os.environ["DYNATRAIN_METRICS_PORT"] = str(args.metrics_port)
    if args.lease_seconds < 3:
        raise SystemExit(f"dynatrain operator: --lease-seconds={args.lease_seconds} must be at "
                         "least 3")
    if args.rendezvous_host:
        os.environ["DYNATRAIN_RENDEZVOUS_HOST"] = args.rendezvous_host
    from dynatrain.operator import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=False)
    election = None
    if not args.standalone:
        election = _elect(args)
    try:
        # kopf's own peering stays off: the Lease decides who acts (dynatrain.operator.leader).
        kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
                 liveness_endpoint=args.liveness)
    finally:
        if election is not None:
            election.release()
    return 0


def _elect(args):
    """Wait until this replica leads; from then on, losing the Lease ends the process at
    once (another replica may act after the lease; two must never act)."""
    from kubernetes import config

    from dynatrain.operator.leader import Election

    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    namespace = (args.lease_namespace or os.environ.get("POD_NAMESPACE")
                 or (args.namespace[0] if args.namespace else "default"))
    election = Election(args.leader_lease, namespace, lease_seconds=args.lease_seconds)
    election.acquire()
    election.keep(on_lost=lambda: os._exit(1))
    return election
