# Shared by the launch/*.sh scripts (sourced, never run): --help from the script's header
# comment, --dry-run, the optional positional models, and the one command they run.
#
#   source "$(dirname "$0")/_common.sh"
#   launch_parse 2 "$@"                     # up to 2 leading positionals -> POS, the rest -> EXTRA
#   launch_exec --speculative-algorithm X ${POS[1]:+--flag "${POS[1]}"}
#
# launch_exec runs `$PYTHON -m sgl_spec.launch_server FLAGS --host $HOST --port $PORT EXTRA`,
# so a flag given by the user (EXTRA) comes last and wins. With --dry-run or DRY_RUN=1 it prints
# that command (shell-quoted, one line) and exits 0 instead.
# shellcheck shell=bash

LAUNCH_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The name every launcher serves when no TARGET is given (sgl_spec.models.registry).
# shellcheck disable=SC2034  # read by the scripts that source this file
SHIPPED_TARGET=sgl-spec/tiny-code
POS=()
EXTRA=()

# The calling script's header comment (from line 2 to the first line that is not a comment).
launch_usage() {
    sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p;}' "$0"
}

launch_die() {
    echo "$(basename "$0"): $*" >&2
    exit 2
}

# launch_parse MAX ARGS...: -h/--help prints the usage and exits 0; --dry-run sets DRY_RUN=1;
# up to MAX leading arguments that do not start with '-' go to POS, everything else to EXTRA.
launch_parse() {
    local max=$1 arg
    shift
    for arg in "$@"; do
        case $arg in
            -h | --help)
                launch_usage
                exit 0
                ;;
            --dry-run) DRY_RUN=1 ;;
            -*) EXTRA+=("$arg") ;;
            *)
                if [[ ${#EXTRA[@]} -eq 0 && ${#POS[@]} -lt $max ]]; then
                    POS+=("$arg")
                else
                    EXTRA+=("$arg")
                fi
                ;;
        esac
    done
}

# launch_uint NAME VALUE: refuse VALUE (of the variable NAME) unless it is an integer >= 0, so
# that shell arithmetic on it means what it says.
launch_uint() {
    [[ $2 =~ ^[0-9]+$ ]] || launch_die "$1 must be a non-negative integer, got '$2'"
}

launch_exec() {
    local cmd=("${PYTHON:-$LAUNCH_ROOT/.venv/bin/python}" -m sgl_spec.launch_server "$@"
        --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}" "${EXTRA[@]}")
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        printf '%q' "${cmd[0]}"
        printf ' %q' "${cmd[@]:1}"
        printf '\n'
        exit 0
    fi
    exec "${cmd[@]}"
}
