# shellcheck shell=bash
# Shared helpers of slurm/*.sbatch; sourced, never run. Every name starts with md_ (functions) or
# MD_ (globals) so nothing clashes with the user's environment.

# Print an error naming its source script and exit 2 (a bad setting, not a failed run).
md_die() {
    printf '%s: error: %s\n' "${MD_PROG:-slurm}" "$*" >&2
    exit 2
}

md_info() {
    printf '[%s] %s\n' "${MD_PROG:-slurm}" "$*" >&2
}

# One command line, quoted for bash: plain words stay bare, anything else goes in single quotes,
# so a --dry-run line can be pasted back into a shell as is.
md_quote() {
    local out="" w
    for w in "$@"; do
        if [[ -n $w && $w =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
            out+="$w "
        else
            out+="'${w//\'/\'\\\'\'}' "
        fi
    done
    printf '%s\n' "${out% }"
}

md_is_true() {
    case "${1,,}" in 1 | true | yes | on) return 0 ;; *) return 1 ;; esac
}

# Split a whitespace-separated string (EXTRA_ARGS, a grid's extra_args) into the named array.
# No quote handling and no glob expansion: values with spaces belong in the YAML config.
md_split_words() {
    local -n _md_into=$1
    _md_into=()
    [[ -n ${2:-} ]] || return 0
    read -r -a _md_into <<<"$2"
}

# First host of a SLURM nodelist ("gpu[001-002],gpu010" -> gpu001) without scontrol.
# Only the first comma-separated item matters; each [..] in it becomes its first element, zero
# padding kept. Handles "a[1-2]-ib", "r[1,3]n[5-6]", and plain "node07".
md_first_host_fallback() {
    local list=$1 item="" c i depth=0
    for ((i = 0; i < ${#list}; i++)); do
        c=${list:i:1}
        if [[ $c == "[" ]]; then
            depth=$((depth + 1))
        elif [[ $c == "]" ]]; then
            depth=$((depth - 1))
        elif [[ $c == "," && $depth -eq 0 ]]; then
            break
        fi
        item+=$c
    done
    local re='^([^[]*)\[([^],-]+)[^]]*\](.*)$'
    while [[ $item =~ $re ]]; do
        item=${BASH_REMATCH[1]}${BASH_REMATCH[2]}${BASH_REMATCH[3]}
    done
    [[ -n $item && $item != *[\[\],]* ]] || return 1
    printf '%s\n' "$item"
}

# First host via `scontrol show hostnames` (authoritative), else the bash parser above.
md_first_host() {
    local list=$1 hosts
    if command -v scontrol >/dev/null 2>&1 && hosts=$(scontrol show hostnames "$list" 2>/dev/null) \
        && [[ -n $hosts ]]; then
        printf '%s\n' "${hosts%%$'\n'*}"
        return 0
    fi
    md_first_host_fallback "$list"
}

# GPUs per node: GPUS_PER_NODE, else what SLURM granted (SLURM_GPUS_ON_NODE, or
# SLURM_GPUS_PER_NODE without its "type:" prefix), else $1; into MD_GPUS.
md_gpus_per_node() {
    local v=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
    if [[ -z $v && -n ${SLURM_GPUS_PER_NODE:-} ]]; then
        v=${SLURM_GPUS_PER_NODE##*:}
    fi
    v=${v:-$1}
    [[ $v =~ ^[1-9][0-9]*$ ]] || md_die "GPUS_PER_NODE=$v: expected a positive integer"
    # shellcheck disable=SC2034  # read by the sourcing script
    MD_GPUS=$v
}

# The interpreter: PYTHON, else $VENV/bin/python with VENV defaulting to the repo's .venv.
md_python() {
    if [[ -n ${PYTHON:-} ]]; then
        printf '%s\n' "$PYTHON"
    else
        printf '%s\n' "${VENV:-$MD_ROOT/.venv}/bin/python"
    fi
}

md_check_python() {
    command -v "$1" >/dev/null 2>&1 \
        || md_die "PYTHON=$1 is not executable: build the venv (make setup) or set VENV or PYTHON"
}

md_need_config() {
    [[ -n ${CONFIG:-} ]] || md_die "CONFIG is not set: point it at a YAML run config (e.g. CONFIG=examples/md_paper/dense-181m_muon_md.yaml)"
    [[ -f $CONFIG ]] || md_die "CONFIG=$CONFIG: file not found (relative paths are from $PWD)"
}

# torchrun's signal flags, into MD_SIGNAL_ARGS. torchrun exits on a signal it does not handle (USR1
# by default), so it is told to catch USR1 and pass it to its workers, then give them
# SHUTDOWN_TIMEOUT seconds to save before SIGKILL; keep that below the 120 s warning of --signal.
md_torchrun_signal_args() {
    local t=${SHUTDOWN_TIMEOUT:-100}
    [[ $t =~ ^[0-9]+$ ]] || md_die "SHUTDOWN_TIMEOUT=$t: expected seconds"
    # shellcheck disable=SC2034  # read by the sourcing script
    MD_SIGNAL_ARGS=(--signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" --shutdown-timeout "$t")
}

MD_GOT_USR1=0
MD_CHILD=""

md_on_usr1() {
    MD_GOT_USR1=1
    md_info "SIGUSR1: the time limit is near; asking the run to save and stop"
    if [[ -n $MD_CHILD ]]; then
        kill -USR1 "$MD_CHILD" 2>/dev/null || true
    fi
}

# Run a command in the background so the batch shell's USR1 trap fires at once (bash defers traps
# while a foreground command runs), forward USR1 to it (srun forwards to its tasks, torchrun to its
# workers), wait until it really ends, then requeue the job if the warning came and the run stopped
# unfinished. --requeue alone requeues only on node failure or preemption, not at the time limit.
md_run_with_requeue() {
    local rc=0
    trap md_on_usr1 USR1
    "$@" &
    MD_CHILD=$!
    wait "$MD_CHILD" || rc=$?
    # wait returns >128 when a trapped signal interrupts it; the child is still running then.
    while ((rc > 128)) && kill -0 "$MD_CHILD" 2>/dev/null; do
        rc=0
        wait "$MD_CHILD" || rc=$?
    done
    trap - USR1
    if ((MD_GOT_USR1 && rc != 0)) && md_is_true "${REQUEUE:-1}"; then
        if command -v scontrol >/dev/null 2>&1 && scontrol requeue "$SLURM_JOB_ID"; then
            md_info "requeued job $SLURM_JOB_ID; it resumes from its checkpoint when it starts again"
        else
            md_info "could not requeue job ${SLURM_JOB_ID:-?}; resubmit it with the same settings to resume"
        fi
    fi
    return "$rc"
}
