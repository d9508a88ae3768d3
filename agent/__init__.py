"""The in-pod agent: a gRPC server inside each training process (server, auth, client),
the worker process it drives (worker: the process; worker_control: the agent's side of its
state; worker_loop: its training loop), and the Prometheus metrics (metrics)."""
