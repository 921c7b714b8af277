"""vLLM's KV cache as the fleet sees it, without vLLM: the block-hash chain a prompt's cached
blocks are keyed by, and the KV-event wire format an engine publishes them in. The
simulator engine publishes with these; the router reads with them."""
