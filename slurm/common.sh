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

# The interpreter: PYTHON, else $VENV/bin/python; VENV defaults to the repo's .venv, except in a container
# (md_container ran first), where the image's own `python` is the default.
md_python() {
    if [[ -n ${PYTHON:-} ]]; then
        printf '%s\n' "$PYTHON"
    elif [[ -n ${VENV:-} || -z ${MD_CONTAINER:-} ]]; then
        printf '%s\n' "${VENV:-$MD_ROOT/.venv}/bin/python"
    else
        printf 'python\n'
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

# ----------------------------------------------------------------------------- per-job names

# What tells this job apart from every other and stays the same when it is requeued (`scontrol requeue` and
# node-failure requeues keep the job id): SLURM_JOB_ID, or ARRAYJOB_TASK for an array task (its own
# SLURM_JOB_ID differs per task but is stable too; the array form is the one squeue and the log names show).
# Outside a job (a dry run): "local".
md_job_key() {
    if [[ -n ${SLURM_ARRAY_JOB_ID:-} && -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
        printf '%s_%s\n' "$SLURM_ARRAY_JOB_ID" "$SLURM_ARRAY_TASK_ID"
    elif [[ -n ${SLURM_JOB_ID:-} ]]; then
        printf '%s\n' "$SLURM_JOB_ID"
    else
        printf 'local\n'
    fi
}

# A string made safe as one directory name: characters outside A-Za-z0-9._- become _.
md_safe_name() {
    local s=$1
    printf '%s\n' "${s//[^A-Za-z0-9._-]/_}"
}

# ----------------------------------------------------------------------------- CUDA and NCCL environment

# Defaults the scripts export (the user's value, set before sbatch, always wins), into MD_ENV_NAMES.
#  - CUDA_DEVICE_MAX_CONNECTIONS=1: with tensor (or context) parallelism on Hopper and older GPUs, Megatron
#    needs one hardware work queue so the TP/sequence-parallel communication kernels are issued in program
#    order and overlap the GEMMs that follow them (megatron/training/arguments.py asserts it for TP>1 or
#    CP>1). It costs nothing measurable for DP-only runs. FSDP and overlap_moe_expert_parallel_comm want
#    more queues: set it to 8 (CUDA's default) or 32, or to an empty value to leave CUDA's default.
#  - NCCL_DEBUG=WARN: NCCL's warnings (a failed IB device, a fallback to sockets) reach the log.
#  - NCCL_IB_TIMEOUT=22: InfiniBand retry timeout 4.096 us x 2^22 (~17 s, NCCL's default 20 is ~4 s), so a
#    congested or flapping link is retried instead of failing the job.
#  - TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a failed or timed-out collective aborts its communicators and ends the
#    process, so srun --kill-on-bad-exit stops the job instead of leaving ranks hung (torch's default 3
#    ends the process without aborting the communicators).
# Network selection (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_NET_GDR_LEVEL, NCCL_TOPO_FILE, UCX_*, FI_*) is
# the site's: set it in your environment or module and it passes through srun unchanged.
md_comm_env() {
    MD_ENV_NAMES=()
    if [[ ! -v CUDA_DEVICE_MAX_CONNECTIONS ]]; then
        export CUDA_DEVICE_MAX_CONNECTIONS=1
    elif [[ -z $CUDA_DEVICE_MAX_CONNECTIONS ]]; then
        unset CUDA_DEVICE_MAX_CONNECTIONS # empty: CUDA's own default
    else
        export CUDA_DEVICE_MAX_CONNECTIONS
    fi
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    local v
    for v in $(compgen -e); do
        case $v in
            CUDA_DEVICE_MAX_CONNECTIONS | NCCL_* | TORCH_NCCL_* | GLOO_* | UCX_* | FI_*) MD_ENV_NAMES+=("$v") ;;
        esac
    done
}

# The communication environment as one pasteable line (what a dry run prints first).
md_env_line() {
    local words=(export) v
    for v in "${MD_ENV_NAMES[@]}"; do
        words+=("$v=${!v}")
    done
    md_quote "${words[@]}"
}

# ----------------------------------------------------------------------------- containers

# CONTAINER_IMAGE (pyxis/enroot: an image or a .sqsh file, run by srun's --container-* flags) or
# APPTAINER_IMAGE (a .sif, run by `apptainer exec --nv`; APPTAINER_BIN=singularity for the older name); neither: the bare environment. Sets
#   MD_CONTAINER         pyxis, apptainer or empty
#   MD_SRUN_CONTAINER    srun flags (pyxis)
#   MD_EXEC_PREFIX       a command prefix (apptainer)
# Mounted at the same path: the repo, the submit directory, and CONTAINER_MOUNTS (comma-separated SRC or
# SRC:DST[:FLAGS], e.g. your data and checkpoint file systems).
# shellcheck disable=SC2034  # MD_SRUN_CONTAINER and MD_EXEC_PREFIX are read by the sourcing script
md_container() {
    MD_CONTAINER="" MD_SRUN_CONTAINER=() MD_EXEC_PREFIX=()
    if [[ -n ${CONTAINER_IMAGE:-} && -n ${APPTAINER_IMAGE:-} ]]; then
        md_die "CONTAINER_IMAGE and APPTAINER_IMAGE are both set: pick pyxis (CONTAINER_IMAGE) or apptainer (APPTAINER_IMAGE)"
    fi
    [[ -n ${CONTAINER_IMAGE:-}${APPTAINER_IMAGE:-} ]] || return 0
    local mounts=("$MD_ROOT") extra=() m
    [[ $PWD == "$MD_ROOT" || $PWD == "$MD_ROOT"/* ]] || mounts+=("$PWD")
    IFS=, read -r -a extra <<<"${CONTAINER_MOUNTS:-}"
    for m in "${extra[@]}"; do
        [[ -n $m ]] && mounts+=("$m")
    done
    if [[ -n ${CONTAINER_IMAGE:-} ]]; then
        MD_CONTAINER=pyxis
        local spec=()
        for m in "${mounts[@]}"; do
            [[ $m == *:* ]] && spec+=("$m") || spec+=("$m:$m") # pyxis wants SRC:DST
        done
        MD_SRUN_CONTAINER=(--container-image="$CONTAINER_IMAGE" --container-mounts="$(IFS=,; printf '%s' "${spec[*]}")"
            --container-workdir="$PWD")
        if [[ -n ${CONTAINER_NAME:-} ]]; then
            MD_SRUN_CONTAINER+=(--container-name="$CONTAINER_NAME")
        fi
    else
        MD_CONTAINER=apptainer
        MD_EXEC_PREFIX=("${APPTAINER_BIN:-apptainer}" exec --nv --bind "$(IFS=,; printf '%s' "${mounts[*]}")"
            --pwd "$PWD" "$APPTAINER_IMAGE")
    fi
    # sourcing scripts read these; the node tasks see MD_CONTAINER through srun's environment
    export MD_CONTAINER
}

# Inside the container: put this checkout first on PYTHONPATH (after the image's own settings, so the
# image's Python finds megatron_md without installing it), then run the command.
md_exec_in_container() {
    export PYTHONPATH="$MD_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    exec "$@"
}

# ----------------------------------------------------------------------------- smoke step

# The smoke check's torchrun arguments after the launcher's own (smoke.py and its flags), into MD_SMOKE_ARGS.
md_smoke_args() {
    MD_SMOKE_ARGS=("$MD_ROOT/slurm/smoke.py")
    if md_is_true "${SMOKE_CPU:-0}"; then
        MD_SMOKE_ARGS+=(--cpu)
    fi
}

# `timeout` in front of the smoke step, into MD_TIMEOUT: SMOKE_TIMEOUT seconds (default 600: a first
# pyxis start imports the image), then SIGKILL 30 s later.
md_smoke_timeout() {
    local t=${SMOKE_TIMEOUT:-600}
    [[ $t =~ ^[1-9][0-9]*$ ]] || md_die "SMOKE_TIMEOUT=$t: expected seconds"
    # shellcheck disable=SC2034  # read by the sourcing script
    MD_TIMEOUT=(timeout --kill-after=30 "$t")
}

# Run the smoke step "$@" (timeout ... srun or torchrun ...) in the background, and stop the job with a clear
# message when it fails, before the long run starts. A USR1 during it (the time limit is near) is
# remembered: the run is then not started, and the job is requeued.
md_run_smoke() {
    local rc=0
    command -v "$1" >/dev/null 2>&1 || md_die "$1 not found on PATH (the smoke step needs it); or skip the step with SKIP_SMOKE=1"
    md_info "smoke step: torch sees every GPU, and one all-reduce across all ranks works (SKIP_SMOKE=1 skips it)"
    # the smoke step is short: let it finish, and only remember the warning
    trap 'MD_GOT_USR1=1; md_info "SIGUSR1 during the smoke step: the run will not start; requeueing"' USR1
    "$@" &
    MD_CHILD=$!
    md_wait_child || rc=$?
    MD_CHILD=""
    trap - USR1
    if ((rc == 124 || rc == 137)) && [[ $1 == timeout ]]; then
        md_info "the smoke step did not finish within SMOKE_TIMEOUT=${SMOKE_TIMEOUT:-600}s: a node, its GPUs or the network hang"
    fi
    if ((rc != 0)); then
        printf '%s: error: the smoke step failed (exit %d; its messages are above), so the long run was not started. Fix what it names (node, image, GPUS_PER_NODE, network), or skip the step with SKIP_SMOKE=1\n' \
            "${MD_PROG:-slurm}" "$rc" >&2
        exit 3
    fi
    if ((MD_GOT_USR1)); then
        md_requeue
        exit 0
    fi
}

# ----------------------------------------------------------------------------- signals and requeue

MD_GOT_USR1=0
MD_CHILD=""

# Wait for MD_CHILD to end and return its exit code. wait returns >128 when a trapped signal interrupts
# it while the child still runs, so wait again until the child is really gone.
md_wait_child() {
    local rc=0
    wait "$MD_CHILD" || rc=$?
    while ((rc > 128)) && kill -0 "$MD_CHILD" 2>/dev/null; do
        rc=0
        wait "$MD_CHILD" || rc=$?
    done
    return "$rc"
}

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
    md_wait_child || rc=$?
    trap - USR1
    if ((MD_GOT_USR1 && rc != 0)); then
        md_requeue
    fi
    return "$rc"
}

# Requeue this job (unless REQUEUE=0): it keeps its job id, so it finds its run directory again.
md_requeue() {
    md_is_true "${REQUEUE:-1}" || return 0
    if command -v scontrol >/dev/null 2>&1 && scontrol requeue "$SLURM_JOB_ID"; then
        md_info "requeued job $SLURM_JOB_ID; it resumes from its checkpoint when it starts again"
    else
        md_info "could not requeue job ${SLURM_JOB_ID:-?}; resubmit it with RUN_NAME (or CKPT_DIR/OUT) of this job to resume"
    fi
}
