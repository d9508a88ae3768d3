"""``dynatrain dev cluster``: run the dev cluster (``dynatrain.devcluster``) in the foreground.

The command builds or reuses the control-plane binaries, starts the cluster, writes the admin
kubeconfig once the simulated nodes are Ready, and then waits; Ctrl-C or SIGTERM stops every
process it started.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

# Only what --help needs is imported here; the cluster modules (and the
# `kubernetes` client they need) are imported when the command runs.
from dynatrain.devcluster.errors import DevClusterError
from dynatrain.devcluster.nodes import NodePool, Taint

_DESCRIPTION = """\
Run a real Kubernetes control plane on 127.0.0.1 in the foreground: etcd,
kube-apiserver, kube-controller-manager, kube-scheduler (all built from the
Kubernetes Go modules pinned in tools/k8s/go.mod, cached under
~/.cache/dynatrain/k8s) and kwok, which simulates GPU nodes: pods requesting
nvidia.com/gpu are scheduled onto them by the real scheduler and reported
Running. The controller-manager garbage-collects a deleted job's objects and
evicts the pods of a node whose heartbeat stops. With --run-pods, every Running
pod's container command also runs, as a local process on its loopback pod IP
(no images are pulled; `dynatrain` means this checkout); the simulated nodes
have no CUDA, so a GPU job's workers train only with --gpu-pods-on-cpu (on the
CPU, with gloo; without it they stop at start). With --real-node, one
more node is run by a real kubelet with containerd and runc (root only): its
pods run in containers, from images built here with debootstrap (the worker
image localhost/dynatrain:dev; the first build takes minutes). Stop with Ctrl-C
(or SIGTERM): every process is stopped and the state directory removed.
"""

_EPILOG = """\
examples:
  dynatrain dev cluster --nodes 4 --gpus-per-node 8 --kubeconfig /tmp/dev.kubeconfig
  KUBECONFIG=/tmp/dev.kubeconfig kubectl get nodes
  dynatrain dev cluster --run-pods --gpu-pods-on-cpu --nodes 2 --kubeconfig /tmp/dev.kubeconfig
  dynatrain dev cluster --real-node --nodes 0 --kubeconfig /tmp/dev.kubeconfig
  dynatrain dev cluster --kueue --run-pods --gpu-pods-on-cpu --kubeconfig /tmp/dev.kubeconfig
  dynatrain dev cluster --build-only      # build/cache the binaries (CI warm-up)
"""


def _taint(text: str) -> Taint:
    # kubectl syntax: KEY[=VALUE]:EFFECT
    try:
        key_value, effect = text.rsplit(":", 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"taint {text!r} is not KEY[=VALUE]:EFFECT") from None
    key, _, value = key_value.partition("=")
    try:
        return Taint(key=key, value=value, effect=effect)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``dev cluster`` to the ``dynatrain`` command line."""
    dev = subparsers.add_parser("dev", help="developer tools (dev cluster)",
                                description="Tools for developing DynaTrain.")
    dev_sub = dev.add_subparsers(dest="dev_command", metavar="COMMAND", required=True)
    p = dev_sub.add_parser(
        "cluster", help="run a loopback Kubernetes control plane with simulated GPU nodes",
        description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, metavar="N",
                   help="number of simulated nodes (default: %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="G",
                   help="nvidia.com/gpu capacity of each node (default: %(default)s)")
    p.add_argument("--cpu", default="96", help="CPU capacity per node (default: %(default)s)")
    p.add_argument("--memory", default="1Ti",
                   help="memory capacity per node (default: %(default)s)")
    p.add_argument("--instance-type", default="p5.48xlarge",
                   help="node.kubernetes.io/instance-type label (default: %(default)s)")
    p.add_argument("--taint", type=_taint, action="append", default=[], metavar="KEY[=V]:EFFECT",
                   help="taint every node (repeatable)")
    p.add_argument("--kubeconfig", type=Path, default=Path("dynatrain-dev.kubeconfig"),
                   help="where to write the admin kubeconfig (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep state and logs here "
                        "(default: a temporary directory, removed on exit)")
    p.add_argument("--run-pods", action="store_true",
                   help="run every Running pod's container command as a local process "
                        "(ConfigMap, Secret and claim volumes as directories; logs under "
                        "the work dir's pods/)")
    p.add_argument("--gpu-pods-on-cpu", action="store_true",
                   help="with --run-pods: run the DynaTrain workers of pods that request "
                        "nvidia.com/gpu on the CPU (--backend gloo appended): the simulated "
                        "GPU nodes have no CUDA, and without this such a worker stops at start "
                        "asking for one")
    p.add_argument("--real-node", action="store_true",
                   help="add one node run by a real kubelet with containerd (root; needs "
                        "tools/install-debs.sh containerd runc containernetworking-plugins "
                        "debootstrap); its pods run in containers of image "
                        "localhost/dynatrain:dev")
    p.add_argument("--kueue", action="store_true",
                   help="also run Kueue (built from the sigs.k8s.io/kueue Go module pinned in "
                        "tools/kueue; root): its CRDs, webhooks and manager, with the plain-pod "
                        "integration; with --build-only, also build it")
    p.add_argument("--build-only", action="store_true",
                   help="only build and cache the binaries, then exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``dynatrain dev cluster``; returns the exit code."""
    try:
        return _run(args)
    except DevClusterError as exc:
        # The message names the component and its log; a traceback adds nothing.
        print(f"dynatrain dev cluster: error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from dynatrain.devcluster.build import (BINARIES, default_toolchain, ensure_built,
                                            pinned_versions)
    from dynatrain.devcluster.cluster import ClusterConfig, DevCluster
    from dynatrain.devcluster.kubelet import RealNodeConfig

    if args.gpu_pods_on_cpu and not args.run_pods:
        print("dynatrain dev cluster: error: --gpu-pods-on-cpu says how --run-pods runs GPU "
              "pods; give --run-pods too", file=sys.stderr)
        return 2
    binaries = ensure_built()
    if args.build_only:
        versions = ", ".join(f"{m} {v}" for m, v in pinned_versions(default_toolchain()).items())
        print(f"binaries ({', '.join(BINARIES)}) for {versions} are in {binaries.bin_dir}")
        if args.kueue:
            from dynatrain.devcluster.kueue import ensure_kueue, source_dir

            path = ensure_kueue()
            print(f"kueue ({source_dir().name}) is {path}")
        return 0

    if args.nodes < 0 or (args.nodes == 0 and not args.real_node):
        print(f"dynatrain dev cluster: error: --nodes {args.nodes}: give at least 1 "
              "(or 0 with --real-node)", file=sys.stderr)
        return 2
    config = ClusterConfig(
        pools=(NodePool(count=args.nodes, gpus_per_node=args.gpus_per_node, cpu=args.cpu,
                        memory=args.memory, instance_type=args.instance_type,
                        taints=tuple(args.taint)),) if args.nodes else (),
        real_nodes=(RealNodeConfig(),) if args.real_node else (),
        kubeconfig=args.kubeconfig.resolve(), kueue=args.kueue,
        workdir=args.workdir.resolve() if args.workdir else None,
        # Pods that run bind their pod IP: it must be an address of this machine.
        **({"pod_cidr": "127.20.0.0/16"} if args.run_pods else {}),
    )
    stop = threading.Event()
    # SIGTERM (systemd, CI, `kill`) must stop the cluster as Ctrl-C does;
    # turning it into KeyboardInterrupt routes both through one cleanup path.
    # SIGINT is set too because a shell script's `cmd &` starts it ignored.
    previous = {sig: signal.signal(sig, _raise_keyboard_interrupt)
                for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster = DevCluster(config, binaries=binaries)
    runner = None
    try:
        cluster.start()
        if args.run_pods:
            from dynatrain.devcluster.pods import PodRunner

            runner = PodRunner(cluster.core(), cluster.workdir / "pods",
                               cpu_for_gpu_pods=args.gpu_pods_on_cpu)
            runner.start()
        kubectl = binaries.path("kubectl")
        print(
            f"\ndev cluster ready, apiserver {cluster.server}\n"
            + (f"{args.nodes} simulated nodes x {args.gpus_per_node} nvidia.com/gpu\n"
               if args.nodes else "")
            + ("Kueue: its manager, webhooks and CRDs (plain-pod integration)\n"
               if args.kueue else "")
            + "".join(f"real node {n.config.name}: kubelet + containerd, node IP {n.node_ip}; "
                      f"image {n.images.get('worker')}; run the operator with "
                      f"--rendezvous-host {n.node_ip} so its pods reach it\n"
                      for n in cluster.real_nodes) +
            f"  export KUBECONFIG={cluster.kubeconfig}\n"
            f"  {kubectl} get nodes\n"
            f"  kubectl apply -f crds/dynatrainjob.yaml\n"
            f"logs: {cluster.workdir / 'logs'}\n"
            + (f"pods run here: kubectl logs / port-forward POD; their files: "
               f"{cluster.workdir / 'pods'}/NAMESPACE/POD/container.log\n" if runner else
               "pods on simulated nodes are not run (see --run-pods)\n" if args.nodes
               else "") +
            "Ctrl-C stops the cluster.", flush=True)
        stop.wait()
    except KeyboardInterrupt:
        print("\nstopping the dev cluster...", file=sys.stderr, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if runner is not None:
            runner.stop()
        cluster.stop()
        if args.kubeconfig.exists():
            # The kubeconfig points at a server that no longer exists.
            args.kubeconfig.unlink()
    print("dev cluster stopped", file=sys.stderr)
    return 0


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt

