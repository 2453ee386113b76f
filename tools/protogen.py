"""Generate the Python gRPC stubs for the wire contract in ``proto/``.

Run with ``make proto`` (or ``python -m tools.protogen [--out DIR]``). The output is
deterministic for pinned ``grpcio-tools`` and ``mypy-protobuf`` versions (see the
``dev`` extra), so ``tests/unit/test_proto_stubs.py`` regenerates into a temporary
folder and fails when the committed stubs in ``kvc/v1/`` are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ("kvc/v1/node_agent.proto",)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) with the mypy-protobuf plugins into ``out_dir``."""
    from grpc_tools import protoc  # dev-only dependency, imported on use

    bin_dir = Path(sys.executable).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *PROTO_FILES,
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    return sorted(p for p in (out_dir / "kvc" / "v1").glob("*_pb2*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root folder")
    ns = parser.parse_args(argv)
    for path in generate(ns.out):
        print(path.relative_to(ns.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
