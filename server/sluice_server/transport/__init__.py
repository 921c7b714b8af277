"""HTTP plumbing below the protocols: the SSE response and the send timeout."""
