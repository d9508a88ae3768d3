"""The in-pod agent: a gRPC server inside each training process (server, auth, client),
the worker process it drives (worker), and the Prometheus metrics (metrics)."""
