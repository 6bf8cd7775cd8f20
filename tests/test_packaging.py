"""What the code imports is what pyproject.toml declares: `transformers` (and the other test
tools) only in tests, every third-party import of the product a declared dependency; benchmarks
may also import what an optional extra they offer declares (`pdserve[plots]`, `pdserve[bench]`)."""

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ["common", "router", "prefill_worker", "decode_worker", "bench"]
MODULE_TO_DIST = {"zmq": "pyzmq", "yaml": "pyyaml", "prometheus_client": "prometheus-client"}


def imported_top_level(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_product_imports_only_declared_dependencies():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(deps):
        return {d.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower() for d in deps}

    declared = names(meta["dependencies"])
    extras = names(d for extra, deps in meta["optional-dependencies"].items() if extra != "test" for d in deps)
    local = set(PRODUCT)
    stdlib = set(sys.stdlib_module_names)
    offenders = {}
    for package in PRODUCT:
        for f in (ROOT / package).rglob("*.py"):
            for name in imported_top_level(f) - stdlib - local:
                allowed = declared | (extras if package == "bench" else set())
                if MODULE_TO_DIST.get(name, name).lower() not in allowed:
                    offenders.setdefault(name, []).append(str(f.relative_to(ROOT)))
    assert offenders == {}, f"imports not declared in pyproject dependencies: {offenders}"
