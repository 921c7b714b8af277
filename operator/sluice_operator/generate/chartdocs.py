"""docs/helm.md's values tables and RBAC table, read from the charts, so neither is typed twice.

- **values**: one row per value of a chart's `values.yaml` (key, type, default,
  description), helm-docs style. A value is documented by the comment block right above its
  key, from the line starting `# --` on; `# -- (int) ...` names the type where the default
  cannot (a `null`). Keys below a documented key are that value's content (the probe
  timings, say), not values of their own; a key without `# --` is a section, and every
  value in it must be documented.
- **rbac**: one row per rule of the operator chart's `templates/_rbac-rules.tpl`: API group,
  resources, verbs, the values that switch it on (its `{{ if .Values.x }}` blocks) and why
  (the comment right above the rule).

Each table sits between `<!-- generated:NAME -->` and `<!-- end:NAME -->` in docs/helm.md;
`outputs` writes and checks the file with the others (`make crds`). The sources are read from
the checkout this package lives in, as the CRD comes from its models.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
HELM_DOC = Path("docs/helm.md")
OPERATOR_VALUES = Path("charts/sluice-operator/values.yaml")
MODEL_VALUES = Path("charts/streaming-model/values.yaml")
RBAC_RULES = Path("charts/sluice-operator/templates/_rbac-rules.tpl")

_MARKER = "# --"
_TYPE_NAMES = {
    bool: "bool",
    int: "int",
    float: "float",
    str: "string",
    list: "list",
    dict: "object",
}


@dataclass(frozen=True)
class Value:
    key: str  # dotted path
    type: str
    default: object
    description: str


@dataclass(frozen=True)
class Rule:
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    when: tuple[str, ...]  # dotted value paths, "not x" for an else branch; () = always
    why: str
    define: str = ""  # the named template that holds it (which Role includes it)
    resource_names: tuple[str, ...] = ()


# ---- values -------------------------------------------------------------------------------


def _description(comment: list[str]) -> tuple[str | None, str]:
    """(type given in parentheses or None, text) of a `# --` comment block."""
    start = next(i for i, line in enumerate(comment) if line == _MARKER or line.startswith("# -- "))
    words = [comment[start][len(_MARKER) :].strip()]
    words += [line.lstrip("#").strip() for line in comment[start + 1 :]]
    text = " ".join(w for w in words if w)
    match = re.match(r"\((\w+)\)\s*(.*)", text, re.S)
    return (match.group(1), match.group(2)) if match else (None, text)


def _lookup(values: dict, key: str) -> object:
    node: object = values
    for part in key.split("."):
        node = node[part]  # type: ignore[index]
    return node


def parse_values(text: str) -> tuple[list[Value], list[str]]:
    """(documented values, undocumented keys) of a values.yaml, in file order."""
    values = yaml.safe_load(text) or {}
    found: list[tuple[str, list[str]]] = []
    sections: list[str] = []
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documented or inside a documented)
    comment: list[str] = []
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            comment = comment + [stripped] if stripped else []
            continue
        marked = any(line == _MARKER or line.startswith("# -- ") for line in comment)
        block, comment = comment, []
        if stripped.startswith("- ") or ":" not in stripped:
            continue
        indent = len(raw) - len(raw.lstrip())
        key = stripped.split(":", 1)[0].strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        inside = any(documented for _, _, documented in stack)
        path = ".".join([k for _, k, _ in stack] + [key])
        if not inside:
            if marked:
                found.append((path, block))
            else:
                sections.append(path)
        stack.append((indent, key, marked or inside))
    rows = []
    for path, block in found:
        typ, text_ = _description(block)
        default = _lookup(values, path)
        rows.append(Value(path, typ or _TYPE_NAMES.get(type(default), "string"), default, text_))
    keys = [r.key for r in rows]
    undocumented = [s for s in sections if not any(k.startswith(s + ".") for k in keys)]
    return rows, undocumented


def _cell(text: str) -> str:
    """Markdown table cell: `|` escaped, and `<` outside code spans, which a renderer would
    otherwise take for an HTML tag and drop (`<release>`)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def values_table(text: str, source: Path) -> str:
    rows, undocumented = parse_values(text)
    if undocumented:
        raise ValueError(f"{source}: values without a `# --` comment: {', '.join(undocumented)}")
    lines = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for r in rows:
        default = json.dumps(r.default, separators=(",", ":"))
        lines.append(f"| `{r.key}` | {r.type} | `{_cell(default)}` | {_cell(r.description)} |")
    return "\n".join(lines) + "\n"


# ---- RBAC ---------------------------------------------------------------------------------

_IF = re.compile(r"\{\{-?\s*if\s+\.Values\.([\w.]+)\s*-?\}\}$")
_ELSE = re.compile(r"\{\{-?\s*else\s*-?\}\}$")
_END = re.compile(r"\{\{-?\s*end\s*-?\}\}$")
_DEFINE = re.compile(r"\{\{-?\s*define\s+\"([^\"]+)\"\s*-?\}\}$")
_EXPR = re.compile(r"\{\{.*?\}\}")  # a value inside a rule, e.g. the Lease's name


def parse_rbac_rules(text: str) -> list[Rule]:
    """The rules of _rbac-rules.tpl with the values that switch each on and its comment."""
    text = re.sub(r"\{\{/\*.*?\*/\}\}", "", text, flags=re.S)
    rules: list[Rule] = []
    when: list[str | None] = []  # None: a define block (no condition)
    comment: list[str] = []
    body: list[str] = []
    define = ""

    def close_rule() -> None:
        if not body:
            return
        (rule,) = yaml.safe_load(_EXPR.sub('"<release fullname>"', "\n".join(body)))
        if not comment:
            raise ValueError(f"{RBAC_RULES}: rule without a comment saying why: {rule}")
        why = " ".join(line.lstrip("#").strip() for line in comment)
        rules.append(
            Rule(
                tuple(rule["apiGroups"]),
                tuple(rule["resources"]),
                tuple(rule["verbs"]),
                tuple(w for w in when if w),
                why,
                define,
                tuple(rule.get("resourceNames") or ()),
            )
        )
        comment.clear()
        body.clear()

    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("{{"):
            close_rule()
            if m := _IF.match(line):
                when.append(m.group(1))
            elif _ELSE.match(line) and when and when[-1]:
                when[-1] = f"not {when[-1]}"
            elif _END.match(line) and when:
                when.pop()
            elif m := _DEFINE.match(line):
                when.append(None)
                define = m.group(1)
            else:
                raise ValueError(f"{RBAC_RULES}: template line the RBAC table cannot read: {line}")
        elif line.startswith("#"):
            close_rule()
            comment.append(line)
        elif raw.startswith("- "):
            close_rule()
            body.append(raw)
        else:
            body.append(raw)
    close_rule()
    return rules


def _when(conditions: tuple[str, ...]) -> str:
    if not conditions:
        return "always"
    return " and ".join(f"not `{c[4:]}`" if c.startswith("not ") else f"`{c}`" for c in conditions)


def rbac_table(text: str) -> str:
    lines = ["| API group | resources | verbs | granted | why |", "|---|---|---|---|---|"]
    for r in parse_rbac_rules(text):
        groups = ", ".join(f"`{g}`" if g else "core" for g in r.api_groups)
        resources = ", ".join(f"`{res}`" for res in r.resources)
        if r.resource_names:
            resources += " (only " + ", ".join(f"`{n}`" for n in r.resource_names) + ")"
        lines.append(
            f"| {groups} | {resources} | {', '.join(r.verbs)} | {_when(r.when)} | {_cell(r.why)} |"
        )
    return "\n".join(lines) + "\n"


# ---- docs/helm.md -------------------------------------------------------------------------


def replace_sections(text: str, parts: dict[str, str]) -> str:
    for name, body in parts.items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n).*?(<!-- end:{name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"{HELM_DOC}: no <!-- generated:{name} --> ... <!-- end:{name} -->")

        def fill(m: re.Match[str], body: str = body) -> str:
            return m.group(1) + body + m.group(2)

        text = pattern.sub(fill, text)
    return text


def sections(repo: Path = REPO) -> dict[str, str]:
    def read(rel: Path) -> str:
        return (repo / rel).read_text()

    return {
        "rbac": rbac_table(read(RBAC_RULES)),
        "operator-values": values_table(read(OPERATOR_VALUES), OPERATOR_VALUES),
        "model-values": values_table(read(MODEL_VALUES), MODEL_VALUES),
    }


def render_helm_doc(repo: Path = REPO) -> str:
    """docs/helm.md with its generated tables as the charts say."""
    return replace_sections((repo / HELM_DOC).read_text(), sections(repo))
