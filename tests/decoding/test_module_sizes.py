"""The decoding package stays in parts a reader can hold: no module over 500 lines, no
function over 100, and `import jaxspec.decoding` loads each module after the modules it
imports (no import circle, no function-level import dodging one)."""

import ast
import pathlib
import subprocess
import sys

import jaxspec.decoding

PACKAGE = pathlib.Path(jaxspec.decoding.__file__).parent
MODULES = sorted(PACKAGE.glob("*.py"))


def test_no_module_over_500_lines_and_no_function_over_100():
    too_long = []
    for path in MODULES:
        source = path.read_text()
        lines = source.count("\n")
        if lines > 500:
            too_long.append(f"{path.name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = node.end_lineno - node.lineno + 1
                if span > 100:
                    too_long.append(f"{path.name}:{node.lineno} {node.name}: {span} lines")
    assert not too_long, too_long


def _decoding_imports(path) -> tuple[set, set]:
    """-> (decoding modules imported at module level, ... inside functions)."""
    top, nested = set(), set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxspec.decoding"):
            names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            where = top if node in tree.body else nested
            where.update(n for n in names if (PACKAGE / (n.rsplit(".", 1)[-1] + ".py")).exists()
                         and n.count(".") == 2)
    return top, nested


def test_each_module_loads_after_the_modules_it_imports():
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import jaxspec.decoding"],
                         capture_output=True, text=True, check=True)
    order = [line.split("|")[-1].strip() for line in out.stderr.splitlines()]
    loaded = [name for name in order if name.startswith("jaxspec.decoding.")]
    position = {name: i for i, name in enumerate(loaded)}
    for path in MODULES:
        name = f"jaxspec.decoding.{path.stem}"
        top, nested = _decoding_imports(path)
        assert not nested, f"{name} imports {nested} inside a function"
        if name not in position:
            continue  # not imported by the package (e.g. oracle)
        late = [m for m in top if position.get(m, -1) > position[name]]
        assert not late, f"{name} finished loading before {late}: an import circle"
        assert "noqa: E402" not in path.read_text(), f"{name}: an import-order noqa"
