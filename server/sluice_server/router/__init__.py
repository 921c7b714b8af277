"""The router: places each request on the model replica whose KV cache already holds its
prompt, balancing by load.

Today the package holds the router's pure parts, importable by any process without vLLM,
torch or a cluster client (the router must start fast):

* `blockhash`: a request's prefix-cache block hashes, computed exactly as vLLM computes them;
* `kvevents`: vLLM's KV-cache event wire format and an asyncio subscriber per replica.
"""
