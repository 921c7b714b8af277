"""HTTP and WebSocket routes, one module per protocol."""
