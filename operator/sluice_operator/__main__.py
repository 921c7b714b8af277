"""`python -m sluice_operator ...` and the `sluice-operator` console script."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
