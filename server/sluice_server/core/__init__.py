"""The core every protocol stands on: the stream buffer and its event loop, admission
(capacity, drain, auth, rate limits), errors, metrics and request validation."""
