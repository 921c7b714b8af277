"""Helpers shared by test suites that live in different folders (tests/ is on pytest's
`pythonpath`, so `from testkit.promtool import ...` works from every suite)."""
