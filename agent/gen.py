"""Generate (or check) the Python stubs of the agent's gRPC contract.

The one source of the contract is ``proto/dynatrain/agent/v1/agent.proto`` beside this module.
The stubs that the agent and the controller import (``dynatrain.agent.v1.agent_pb2``,
``agent_pb2.pyi`` and ``agent_pb2_grpc``) are generated from it with ``grpc_tools.protoc`` and
checked in, so that installing the package needs no protobuf compiler. This module writes
them::

    python -m dynatrain.agent.gen             # regenerate agent/v1/agent_pb2*.py[i]
    python -m dynatrain.agent.gen --check     # exit 1, naming the files, if they are stale
    python -m dynatrain.agent.gen --check --out DIR   # check (or write) another directory

protoc runs with ``-I <package>/proto``, so the generated code names the proto by its
package-relative path (``dynatrain/agent/v1/agent.proto``) and imports its siblings as
``dynatrain.agent.v1``; the output goes to a temporary directory first and only the three
stub files are copied out, which keeps the output byte-for-byte independent of where the
repository lives. The output depends on the grpcio-tools version (it embeds the protobuf and
gRPC versions it was made with), which is why pyproject pins grpcio-tools.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from importlib import metadata, resources
from pathlib import Path

PROTO_ROOT = Path(__file__).parent / "proto"
PROTO_FILE = "dynatrain/agent/v1/agent.proto"  # relative to PROTO_ROOT; protoc embeds this path
STUB_NAMES = ("agent_pb2.py", "agent_pb2.pyi", "agent_pb2_grpc.py")
DEFAULT_OUT = Path(__file__).parent / "v1"


class GenerateError(RuntimeError):
    """protoc failed or is not installed; the message says which and how to fix it."""


def _protoc(out_dir: Path) -> None:
    """Run protoc on the agent proto, writing the python, pyi and grpc outputs to ``out_dir``."""
    try:
        from grpc_tools import protoc
    except ImportError as e:  # grpcio-tools is a test/dev extra, not a runtime dependency
        raise GenerateError(
            f"grpc_tools is not installed ({e}); install the test extra "
            "(pip install -e '.[test]') for the pinned grpcio-tools") from None
    # The well-known types (google/protobuf/*.proto) ship inside grpc_tools; the agent proto
    # uses none today, but putting them on the path keeps a later import from breaking gen.
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",  # argv[0]; protoc ignores it
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        PROTO_FILE,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise GenerateError(f"protoc exited with {rc} on {PROTO_ROOT / PROTO_FILE} "
                            "(its message is printed above)")


def generate_stubs() -> dict[str, bytes]:
    """Generate the stubs and return them as ``{file name: content}``."""
    with tempfile.TemporaryDirectory(prefix="dynatrain-agent-gen-") as tmp:
        _protoc(Path(tmp))
        produced = Path(tmp) / Path(PROTO_FILE).parent
        stubs = {}
        for name in STUB_NAMES:
            path = produced / name
            if not path.is_file():
                raise GenerateError(f"protoc did not produce {name} in {produced}")
            stubs[name] = path.read_bytes()
        return stubs


def write_stubs(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """Regenerate the stubs into ``out_dir`` (created if missing); returns the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in generate_stubs().items():
        path = out_dir / name
        path.write_bytes(content)
        written.append(path)
    return written


def stale_stubs(out_dir: Path = DEFAULT_OUT) -> list[str]:
    """Names of the stub files in ``out_dir`` that are missing or differ from fresh output."""
    out_dir = Path(out_dir)
    stale = []
    for name, content in generate_stubs().items():
        path = out_dir / name
        if not path.is_file() or path.read_bytes() != content:
            stale.append(name)
    return stale


def _tools_version() -> str:
    try:
        return metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        return "(unknown version)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynatrain.agent.gen",
        description="Generate the agent's gRPC stubs from "
                    f"{PROTO_FILE} (or check that the checked-in ones are current).")
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 naming the stub files that differ")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="directory of the stubs (default: the package's v1/)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_stubs(args.out)
            if stale:
                print(f"stale agent stubs in {args.out}: {', '.join(stale)}\n"
                      f"  they differ from what grpcio-tools {_tools_version()} "
                      f"generates from {PROTO_ROOT / PROTO_FILE};\n"
                      "  run `python -m dynatrain.agent.gen` and commit the result "
                      "(with the grpcio-tools version pinned in pyproject.toml)",
                      file=sys.stderr)
                return 1
            print(f"agent stubs in {args.out} are up to date")
            return 0
        for path in write_stubs(args.out):
            print(f"wrote {path}")
        return 0
    except GenerateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
