"""In-pod agent: the gRPC server that runs beside each training process (later issue)."""
