"""What the tests share: the harness, not tests themselves.

- :mod:`.operator_process`: ``dynatrain operator`` as a separate process (from the slim
  operator environment), the job manifests and the reads the operator tests make;
- :mod:`.chart_rbac`: the chart's ServiceAccount identity on a dev cluster (so a verb missing
  from the chart's RBAC fails the tests);
- :mod:`.pod_endpoints`: ``kubectl logs``/``exec``/``port-forward`` checks of a pod;
- :mod:`.prometheus_server`: a real Prometheus scraping the tests' targets;
- :mod:`.pod_runner`: the operator tests' pod runner and its two stand-in settings (GPU
  workers on the CPU, worker pods forked from a torch-loaded server);
- :mod:`.switch_harness` and :mod:`.ncclsim_ranks`: rank processes of the trainer's switch and
  of the nccl-sim scenarios;
- :mod:`.strategies`: the hypothesis strategies (models, layouts, transitions) of the vps
  property tests and of ``benchmarks/plan_held_out.py``.

Ports come from :func:`dynatrain.ports.free_port`; the dev cluster's fixtures are in
``tests/k8s/conftest.py`` (pytest finds fixtures in conftest files only). Tests import these
as ``harness.X``: pytest puts ``tests/`` on ``sys.path`` (the root conftest's directory).
"""
