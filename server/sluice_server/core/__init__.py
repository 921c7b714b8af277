"""The core every protocol stands on: who is calling (auth/), what they and the pod may use
(limits/), one stream from the engine to the socket (streaming/) and what the server reports
(telemetry/); over them what the routes share (services) and a stream's start and finish
(lifecycle), beside errors, request validation (params) and LoRA adapters (adapters)."""
