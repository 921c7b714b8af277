"""Sluice streaming server: FastAPI + uvicorn on vLLM's async engine."""
