"""``python -m megatrace.trace.nccl``: print the interposer's path, for ``LD_PRELOAD``.

    MEGATRACE_ENABLE=1 LD_PRELOAD=$(python -m megatrace.trace.nccl) srun ... ./trainer
    python -m megatrace.trace.nccl --build [DIR]   # compile it (to DIR, default: the package)
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatrace.trace.nccl import InterposerMissing, build, library_path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    try:
        if args[:1] == ["--build"]:
            print(build(Path(args[1]) if len(args) > 1 else None))
        elif args:
            print(f"Error: unknown arguments {' '.join(args)} (see --help)", file=sys.stderr)
            return 2
        else:
            print(library_path())
    except (InterposerMissing, OSError) as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
