"""Generate the protobuf/gRPC Python modules from proto/ (``make proto``).

The generated files are committed (so a plain install needs no grpcio-tools);
``tests/unit/v1/test_proto.py`` regenerates them into a temporary folder and fails when
the committed copies are stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
PROTO_FILES = ("kvstore/v1/kvstore.proto",)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) and return the files it wrote."""
    from grpc_tools import protoc  # dev dependency; imported only here
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for proto in PROTO_FILES:
        stem = Path(proto).with_suffix("")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            written.append(out_dir / f"{stem}{suffix}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: repo root)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
