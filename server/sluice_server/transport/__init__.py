"""HTTP plumbing below the protocols: the SSE response, the send timeout, and credentials
kept out of log lines."""
