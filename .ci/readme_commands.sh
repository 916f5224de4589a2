#!/usr/bin/env bash
# Prints the commands of the README's first code block, one per line (comments and blank lines dropped):
# the commands a fresh machine runs, which CI runs exactly (.ci/run compares this list with its own).
#   .ci/readme_commands.sh [README.md]
set -euo pipefail
awk '/^```/ { if (inblock) exit; inblock = 1; next }
     inblock { sub(/#.*/, ""); gsub(/^[ \t]+|[ \t]+$/, ""); if ($0 != "") print }' "${1:-README.md}"
