#!/usr/bin/env bash
# Keeps the shipped weights (~105 MB of *.safetensors) out of what travels to a GPU machine
# lent through a tool that sends the git-tracked and untracked-not-ignored files (docs/gpu.md).
# usage: launch/gpu/travel.sh out    untrack the weights in the index and ignore them locally
#        launch/gpu/travel.sh back   track them again (the files never leave the disk)
#        launch/gpu/travel.sh size [CARRIED_DIR...]   MiB that would travel, with those dirs
# Between `out` and `back` the index shows the weights as deleted: do not commit then.
set -euo pipefail
cd "$(dirname "$0")/../.."
WEIGHTS='sgl_spec/models/weights/*/*.safetensors'
EXCLUDE=$(git rev-parse --git-path info/exclude)
MARK='# launch/gpu/travel.sh out (travel.sh back removes these two lines)'

size() {
    local files
    files=$( { git ls-files -z --cached --others --exclude-standard; for d in "$@"; do
        find "$d" -type f -print0; done; } | xargs -0 -r du -cb -- 2>/dev/null | tail -1 | cut -f1)
    python3 -c "import sys; print(f'travel: {int(sys.argv[1]) / 2**20:.1f} MiB would travel')" \
        "${files:-0}"
}

case "${1:-}" in
    out)
        git rm -r -q --cached --ignore-unmatch -- "$WEIGHTS"
        mkdir -p "$(dirname "$EXCLUDE")"
        grep -qxF "/$WEIGHTS" "$EXCLUDE" 2>/dev/null || printf '%s\n/%s\n' "$MARK" "$WEIGHTS" >> "$EXCLUDE"
        size ;;
    back)
        if [ -f "$EXCLUDE" ]; then
            grep -vxF -e "$MARK" -e "/$WEIGHTS" "$EXCLUDE" > "$EXCLUDE.tmp" || true
            mv "$EXCLUDE.tmp" "$EXCLUDE"
        fi
        git reset -q -- sgl_spec/models/weights
        git status --short -- sgl_spec/models/weights
        size ;;
    size)
        shift; size "$@" ;;
    *)
        sed -n '2,8p' "$0" >&2; exit 2 ;;
esac
