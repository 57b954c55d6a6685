"""The package layout the README and docs/design.md describe is the one `tests/test_imports.py` enforces:
the README's code-layout block names every package, its import-order sentence lists the layers bottom
to top, and design.md's layer diagram gives each package its layer. Each is parsed from the text; a
failure names the package that is missing, extra or in the wrong layer."""

from __future__ import annotations

import re
from pathlib import Path

from test_imports import LAYERS

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {name: layer for name, layer in LAYERS.items() if name != "boostjax"}  # the root has no line
ARROW = "→"


def _fenced_after(text: str, heading: str) -> str:
    """The first fenced block after the heading `heading` (a whole line, e.g. `## Code layout`)."""
    m = re.search(rf"^{re.escape(heading)}\n.*?^```\w*\n(.*?)^```", text, re.M | re.S)
    assert m, f"no fenced block after '{heading}'"
    return m.group(1)


def readme_layout(text: str) -> list[str]:
    """The packages (`config` for config.py) the README's code-layout block lists, in its order."""
    return re.findall(r"^boostjax/(\w+)(?:/|\.py)\s", _fenced_after(text, "## Code layout"), re.M)


def readme_import_order(text: str) -> list[set[str]]:
    """The layers of the sentence `A package imports only the layers below it (a, b → c → ...; ...)`,
    bottom to top: `→` separates layers, `,` the packages of one layer."""
    m = re.search(r"imports only the layers below it\s+\(([^;)]*)", text)
    assert m, "README.md: no sentence 'A package imports only the layers below it (...)'"
    return [{p.strip() for p in step.split(",")} for step in " ".join(m.group(1).split()).split(ARROW)]


def design_layers(text: str) -> dict[str, int]:
    """package -> layer from design.md's diagram: a line `N  boostjax/pkg/ ...` starts layer N, and a
    line `   boostjax/pkg/ ...` without a number is in the layer above it in the text."""
    out: dict[str, int] = {}
    layer = None
    for line in _fenced_after(text, "## The layers").splitlines():
        m = re.match(r"^\s*(\d+)?\s+boostjax/(\w+)(?:/|\.py)\s", line)
        if m:
            layer = int(m.group(1)) if m.group(1) else layer
            assert layer is not None, f"design.md: {line.strip()!r} comes before any layer number"
            out[m.group(2)] = layer
    return out


def _differences(found: set[str], want: set[str]) -> str:
    return f"missing {sorted(want - found)}, extra {sorted(found - want)}"


def _by_layer() -> list[set[str]]:
    return [{p for p, n in PACKAGES.items() if n == k} for k in sorted(set(PACKAGES.values()))]


def layout_problems(text: str) -> list[str]:
    listed = readme_layout(text)
    out = [f"README code layout lists {p} twice" for p in sorted({p for p in listed if listed.count(p) > 1})]
    if set(listed) != set(PACKAGES):
        out.append("README code layout: " + _differences(set(listed), set(PACKAGES)))
    return out


def import_order_problems(text: str) -> list[str]:
    found, want = readme_import_order(text), _by_layer()
    out = []
    if set().union(*found) != set(PACKAGES):
        out.append("README import order: " + _differences(set().union(*found), set(PACKAGES)))
    for k, (f, w) in enumerate(zip(found, want)):
        if f != w:
            out.append(f"README import order, step {k + 1}: has {sorted(f)}, tests/test_imports.py's layer {k} is {sorted(w)}")
            break
    if len(found) != len(want):
        out.append(f"README import order has {len(found)} steps, tests/test_imports.py {len(want)} layers")
    return out


def design_problems(text: str) -> list[str]:
    found = design_layers(text)
    out = [] if set(found) == set(PACKAGES) else ["design.md layers: " + _differences(set(found), set(PACKAGES))]
    out += [f"design.md puts {p} in layer {found[p]}, tests/test_imports.py in {PACKAGES[p]}"
            for p in sorted(set(found) & set(PACKAGES)) if found[p] != PACKAGES[p]]
    return out


def test_the_readme_layout_block_lists_every_package_once():
    problems = layout_problems((ROOT / "README.md").read_text())
    assert not problems, "\n".join(problems)


def test_the_readme_import_order_is_the_layer_order():
    problems = import_order_problems((ROOT / "README.md").read_text())
    assert not problems, "\n".join(problems)


def test_the_design_diagram_gives_each_package_its_layer():
    problems = design_problems((ROOT / "docs" / "design.md").read_text())
    assert not problems, "\n".join(problems)


def test_the_checks_name_what_is_wrong():
    readme = (ROOT / "README.md").read_text()
    design = (ROOT / "docs" / "design.md").read_text()
    without = re.sub(r"^boostjax/planning/.*\n", "", readme, flags=re.M)
    assert layout_problems(without) == ["README code layout: missing ['planning'], extra []"]
    extra = readme.replace("boostjax/cli/", "boostjax/cli/ \nboostjax/extra/ x\nboostjax/cli/", 1)
    assert layout_problems(extra) == ["README code layout lists cli twice",
                                      "README code layout: missing [], extra ['extra']"]
    merged = readme.replace(f"analysis {ARROW} planning", "analysis, planning", 1)
    assert merged != readme and import_order_problems(merged)[0].startswith("README import order, step 8: has ['analysis', 'planning']")
    dropped = readme.replace(f" {ARROW} planning", "", 1)
    assert import_order_problems(dropped)[0] == "README import order: missing ['planning'], extra []"
    moved = re.sub(r"^ 9  boostjax/cli/", " 8  boostjax/cli/", design, flags=re.M)
    assert moved != design and design_problems(moved) == ["design.md puts cli in layer 8, tests/test_imports.py in 9"]
    gone = re.sub(r"^.*boostjax/planning/.*\n", "", design, flags=re.M)
    assert design_problems(gone)[0] == "design.md layers: missing ['planning'], extra []"
