"""What the code imports is what pyproject.toml declares: `transformers` (and the other test
tools) only in tests, every third-party import of the product a declared dependency; benchmarks
may also import what an optional extra they offer declares (`pdserve[plots]`, `pdserve[bench]`),
and the product an optional extra's module where it does without it (`try: import triton` /
`except ImportError`: `pdserve[gpu]`)."""

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ["common", "router", "prefill_worker", "decode_worker", "bench"]
MODULE_TO_DIST = {"zmq": "pyzmq", "yaml": "pyyaml", "prometheus_client": "prometheus-client"}


def imported_top_level(path: Path, guarded_only: bool = False) -> set[str]:
    """Top-level modules a file imports; with guarded_only, those imported inside a `try` whose
    handlers catch ImportError (the product does without them)."""
    tree = ast.parse(path.read_text())
    if guarded_only:
        roots = [stmt for node in ast.walk(tree) if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers)
                 for stmt in node.body]
    else:
        roots = [tree]
    names = set()
    for root in roots:
        for node in ast.walk(root):
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
            guarded = imported_top_level(f, guarded_only=True)
            for name in imported_top_level(f) - stdlib - local:
                allowed = declared | (extras if package == "bench" or name in guarded else set())
                if MODULE_TO_DIST.get(name, name).lower() not in allowed:
                    offenders.setdefault(name, []).append(str(f.relative_to(ROOT)))
    assert offenders == {}, f"imports not declared in pyproject dependencies: {offenders}"


def test_a_cpu_worker_and_its_engine_never_import_triton():
    """Triton (the GPU extra) costs a process 0.2 s to import: a CPU worker, which never launches a
    Triton kernel, must not pay it (the kernel modules are imported only where a GPU needs them)."""
    import subprocess

    code = ("import sys, os; os.environ.pop('TRITON_INTERPRET', None)\n"
            "import common.cli, common.kv_transport, decode_worker.worker, prefill_worker.worker\n"
            "from common.engine import Engine\n"
            "Engine(model='dummy:llama-tiny').generate([[1, 2, 3]])\n"
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
