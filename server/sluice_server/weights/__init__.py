"""The weights download program: `python -m sluice_server.weights fetch` (and `remove`).

The operator runs it in a Job, once per (repository, revision), to fill a weights cache
volume that model pods then mount read-only and read with the Hub off. It resolves the
revision to a commit, downloads every file with `huggingface_hub` (its resume and ETag
handling, `HF_ENDPOINT` for a mirror) into `<root>/<org>/<name>/<commit>/`, checks each
file against the Hub's metadata (size; sha256 for LFS files, git's blob SHA-1 for the
others) and writes `.sluice-weights.json` last. The outcome goes to the Kubernetes
termination message (`result.py`); progress is served over HTTP while it runs
(`progress.py`). docs/weights-cache.md, "The download program", is the user's reference.

It imports nothing of vLLM, torch or the serving code: a Job starts it in about a second.
"""
