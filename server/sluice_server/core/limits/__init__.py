"""What a pod and a caller may use: the pod's stream slots and the drain switch (slots), the
admission queue in front of them (queue), per-caller rate limits (ratelimit), and the shared
memory that makes each of them the pod's across its worker processes (shared_memory).
"""
