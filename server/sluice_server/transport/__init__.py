"""HTTP plumbing below the protocols: the SSE response, the send timeout and early
coalescing on the connection's transport, and what uvicorn logs (credentials kept out of
log lines, a refused handshake not an error)."""
