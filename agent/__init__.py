"""The in-pod agent: a gRPC server inside each training process (server: the Control interface,
the servicer and serve; requests: the request checks; errors: the protocol's errors; serving:
the gRPC plumbing; auth, client), the worker process it drives (worker: the process and its
Worker; worker_control: the worker's state and the agent's side of it; worker_loop: its
training loop, which holds a reference to that control), and the Prometheus metrics
(metrics)."""
