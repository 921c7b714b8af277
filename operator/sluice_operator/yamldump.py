"""The one YAML style for everything the operator prints or writes (CRD, rendered manifests).

Block sequences are indented under their key, which is what yamllint's default
`indentation` rule wants, so generated files pass `make lint` as written.
"""

from __future__ import annotations

from typing import Any

import yaml


class IndentedDumper(yaml.SafeDumper):
    """Indents block sequences under their key (what yamllint's default `indentation` wants)."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        return super().increase_indent(flow, False)


def dump_yaml(obj: Any) -> str:
    return yaml.dump(obj, Dumper=IndentedDumper, sort_keys=False, width=120, allow_unicode=True)
