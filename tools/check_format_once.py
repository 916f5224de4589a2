#!/usr/bin/env python3
"""The format exists once: fail when a known constant or formula of docs/FORMAT.md appears in a
source file other than its one home (the format core: include/fmkv/format.h, src/format/).

    tools/check_format_once.py [ROOT]     (exit 1 and a list of offending lines on a second copy)

Each rule is a pattern that only a restatement of the rule would contain; tests (which check the
rules against independent values) and docs are not scanned. Run by tests/python/test_format_once.py.
"""
from __future__ import annotations

import pathlib
import re
import sys

SCANNED = ("src", "include", "python", "bench", "cli", "tools")
SUFFIXES = {".h", ".hpp", ".c", ".cpp", ".cc", ".cu", ".cuh", ".mm", ".metal", ".inc", ".py"}

# (rule, regex, home files, {other file: why it may contain the pattern})
RULES = [
    ("rotation: splitmix64 and layer-mixing constants",
     r"(?i)0x9E3779B97F4A7C15|0xD6E8FEB86659FD93|0xBF58476D1CE4E5B9|0x94D049BB133111EB",
     {"include/fmkv/format.h"},
     {"bench/cuda_bench.cu": "the golden-ratio multiplier of its random-data hash, not the rotation"}),
    ("rotation: float32 nearest 1/sqrt(d)", r"(?i)0x3DB504F3|0\.08838834", {"include/fmkv/format.h"}, {}),
    ("layout: bytes per token per head", r"4\s*\*\s*(\(int64_t\))?\s*bits\s*\+\s*2", {"include/fmkv/format.h"}, {}),
    ("scale: saturation to 65504 (0x7bff)", r"(?i)0x7bff", {"src/format/numbers.h"}, {}),
    ("number formats: fp16 <-> float32 rounding", r"(?i)0x1fffu|5\.9604644775390625e-8|e \+ 112",
     {"src/format/numbers.h"}, {}),
    ("codebook levels (generated once)", r"(?i)0x3a62|0x373f|0x3e0b|0x33d8|0x3a0c|0x301c|0x3635",
     {"src/format/codebooks.inc"}, {}),
    ("token regions: compressed end max(S, len - W)",
     r"max\(\s*\w*\.?sink_tokens\s*,\s*\w+\s*-\s*\w*\.?window_tokens\s*\)|len\s*-\s*c(fg_?)?\.window_tokens",
     {"include/fmkv/format.h"}, {}),
    ("packed rows: the row -> sequence binary search", r"\(lo \+ hi \+ 1\) >> 1", {"src/format/rows.h"}, {}),
    ("code widths: the supported set (FMKV_CODE_BITS_MIN .. MAX; messages from fmkv/format_text.hpp)",
     r"[(\[{]\s*2\s*,\s*3\s*,\s*4\b|\"2, ?3, ?4|2, 3 or 4\b|bits >= 2 && bits <= 4",
     {"include/fmkv/format.h", "include/fmkv/format_text.hpp"},
     {"python/src/format.cpp": "comments showing the texts it exports",
      "python/fmkv/format.py": "comments showing the texts it re-exports"}),
]


def scan(root: pathlib.Path):
    bad = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            if rel == "tools/check_format_once.py":
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            for rule, rx, homes, allowed in RULES:
                if rel in homes or rel in allowed:
                    continue
                for n, line in enumerate(text.splitlines(), 1):
                    if re.search(rx, line):
                        bad.append(f"{rel}:{n}: {rule} (its home: {', '.join(sorted(homes))}): {line.strip()}")
    return bad


def main(argv) -> int:
    root = pathlib.Path(argv[1] if len(argv) > 1 else pathlib.Path(__file__).resolve().parents[1])
    bad = scan(root)
    for b in bad:
        print(b)
    print(f"check_format_once: {len(RULES)} rules, {len(bad)} restatements outside the format core")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
