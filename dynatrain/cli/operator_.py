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
                   help="no peering: act even if other operators run (single replica)")
    p.add_argument("--peering", default="dynatrain",
                   help="peering name: among replicas with the same name, one acts")
    p.add_argument("--priority", type=int, default=0, help="peering priority")
    p.add_argument("--peering-lifetime", type=int, default=60,
                   help="seconds a silent replica counts as alive (default 60)")
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
    os.environ["DYNATRAIN_PEERING_LIFETIME_S"] = str(args.peering_lifetime)
    if args.rendezvous_host:
        os.environ["DYNATRAIN_RENDEZVOUS_HOST"] = args.rendezvous_host
    from dynatrain.operator import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=False)
    # kopf makes peering mandatory whenever a peering name is given, and with --standalone
    # there is no peering to find: every watch would stay paused and no job be handled.
    peering = {} if args.standalone else {"peering_name": args.peering}
    kopf.run(standalone=args.standalone, priority=args.priority, **peering,
             clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness)
    return 0
