"""Rewrite a wheel without the members a drop list names, keeping it installable.

    python launch/gpu/slim_wheel.py IN.whl OUT_DIR --drop 'sglang/multimodal_gen/*' ...

The slimmed wheel keeps its file name (same project, same version): pip installs it like the
original. Its ``RECORD`` lists exactly the members kept (with their original hashes), and a
``SLIMMED`` file in the ``.dist-info`` folder names every pattern applied and what it removed,
so an installed copy says it is not the published wheel. The script refuses a pattern that
matches nothing (a stale drop list) and one that would remove a ``.dist-info`` member.
Prints one JSON line: members and bytes before and after, per pattern what it dropped.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import zipfile
from pathlib import Path


def _dist_info(names: list[str]) -> str:
    dirs = {name.split("/", 1)[0] for name in names if name.split("/", 1)[0].endswith(".dist-info")}
    if len(dirs) != 1:
        raise SystemExit(f"slim_wheel: expected one .dist-info folder, found {sorted(dirs)}")
    return dirs.pop()


def slim(src: Path, out_dir: Path, patterns: list[str]) -> dict:
    """Write ``out_dir / src.name`` without the members matching ``patterns``; return a report."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / src.name
    if dst.resolve() == src.resolve():
        raise SystemExit("slim_wheel: OUT_DIR must differ from the input wheel's folder")
    with zipfile.ZipFile(src) as zin:
        infos = zin.infolist()
        names = [info.filename for info in infos]
        dist_info = _dist_info(names)
        record_name = f"{dist_info}/RECORD"
        dropped: dict[str, list[str]] = {pattern: [] for pattern in patterns}
        kept = []
        for info in infos:
            hit = next((p for p in patterns if fnmatch.fnmatch(info.filename, p)), None)
            if hit is None:
                kept.append(info)
                continue
            if info.filename.startswith(dist_info + "/"):
                raise SystemExit(f"slim_wheel: pattern {hit!r} would drop {info.filename}")
            dropped[hit].append(info.filename)
        unused = [pattern for pattern, hits in dropped.items() if not hits]
        if unused:
            raise SystemExit(f"slim_wheel: patterns match nothing in {src.name}: {unused}")
        gone = {name for hits in dropped.values() for name in hits}
        record = zin.read(record_name).decode()
        slimmed_name = f"{dist_info}/SLIMMED"
        note = "".join(f"{p}\t{len(h)} files\n" for p, h in dropped.items())
        record_lines = [
            line for line in record.splitlines() if line and line.split(",", 1)[0] not in gone
        ]
        record_lines.insert(-1 if record_lines else 0, f"{slimmed_name},,")
        with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_DEFLATED) as zout:
            for info in kept:
                data = (
                    ("\n".join(record_lines) + "\n").encode()
                    if info.filename == record_name
                    else zin.read(info)
                )
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            zout.writestr(slimmed_name, f"slimmed from {src.name} by sgl-spec\n{note}")
    return {
        "wheel": src.name,
        "members_before": len(infos),
        "members_after": len(kept) + 1,
        "bytes_before": src.stat().st_size,
        "bytes_after": dst.stat().st_size,
        "dropped": {p: len(h) for p, h in dropped.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--drop", action="append", required=True, metavar="GLOB")
    args = parser.parse_args(argv)
    print(json.dumps(slim(args.wheel, args.out_dir, args.drop)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
