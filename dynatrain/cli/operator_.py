"""``dynatrain operator``: run the Kubernetes operator (kopf) for DynaTrainJob objects.

The module is named ``operator_`` so that it can never shadow the standard library's
``operator``; the handlers themselves live in ``dynatrain.operator``.
"""

from __future__ import annotations

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
    p.add_argument("--worker-cpu", default="1", metavar="QUANTITY",
                   help="CPU request and limit of workers whose job sets no "
                   "spec.resources.cpu (default 1)")
    p.add_argument("--worker-memory", default="4Gi", metavar="QUANTITY",
                   help="memory request and limit of workers whose job sets no "
                   "spec.resources.memory (default 4Gi)")
    p.set_defaults(func=run_operator)


def run_operator(args) -> int:
    import kopf
    from kubernetes.utils import parse_quantity

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
    os.environ["DYNATRAIN_MAX_PODS_PER_JOB"] = str(args.max_pods_per_job)
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
