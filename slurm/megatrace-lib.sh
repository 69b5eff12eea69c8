# MegaTrace: what the Slurm prolog and epilog share (sourced by both; never run on its own).
#
# Installed beside them, root-owned and writable by nobody else: they refuse to source it otherwise.
# Sets the defaults of /etc/megatrace/slurm.conf and the functions that decide which directories root
# may act on (docs/security.md):
#   - a base (LOCAL_DIR, FALLBACK_DIR) is a real directory of root's;
#   - the job's node directory and its fallback directory are made by root, the job's user's, mode 0700;
#   - a job directory is used only when it is the job's user's, others cannot write it, and its parent
#     is one others cannot write either unless it is sticky (like /tmp);
#   - everything inside a user's directory is done as that user (setpriv), never as root.
# The caller sets LOG_TAG (megatrace-prolog, megatrace-epilog) first.

SITE_CONF=/etc/megatrace/slurm.conf
MEGATRACE_BIN=/usr/local/bin/megatrace
CHECK_CMD=""
LOCAL_DIR=/dev/shm/megatrace
FALLBACK_DIR=/var/tmp/megatrace
RUN_DIR=/run/megatrace
CHECK_TIMEOUT=100
ANALYZE_TIMEOUT=90
SLURM_BIN=""  # the site's Slurm commands (':'-separated directories); empty: beside the slurmd that runs us
SLURM_CONF="${SLURM_CONF:-}"
SYSTEM_PATH=/usr/sbin:/usr/bin:/sbin:/bin

log() { logger -t "$LOG_TAG" -- "$*" 2>/dev/null; printf '%s: %s\n' "${LOG_TAG/-/ }" "$*" >&2; }

# KEY=VALUE lines of the root-owned site config; read, never sourced.
read_site_conf() {
	local key value owner mode
	[ -f "$SITE_CONF" ] || return 0
	owner=$(stat -c %u -- "$SITE_CONF") mode=$(stat -c %a -- "$SITE_CONF")
	if [ "$owner" != 0 ] || [ $((8#$mode & 8#022)) != 0 ]; then
		log "ignoring $SITE_CONF: not root-owned or writable by others"
		return 0
	fi
	while IFS='=' read -r key value; do
		case "$key" in
		MEGATRACE_BIN | CHECK_CMD | CHECK_TIMEOUT | ANALYZE_TIMEOUT | LOCAL_DIR | FALLBACK_DIR | RUN_DIR | \
			SLURM_BIN | SLURM_CONF | HEALTH_ARGS | HEALTH_ALERTS | HEALTH_TIMEOUT)
			printf -v "$key" '%s' "$value" ;;
		'' | \#*) ;;
		*) log "unknown key $key in $SITE_CONF" ;;
		esac
	done <"$SITE_CONF"
}

# The slurmd (or slurmstepd) this script runs under: the path of its executable, from /proc.
slurmd_exe() {
	local pid=$$ comm stat
	while [ "$pid" -gt 1 ]; do
		comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
		case "$comm" in slurmd | slurmstepd)
			readlink "/proc/$pid/exe" && return 0 ;;
		esac
		stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
		stat=${stat##*) }
		pid=$(printf '%s' "$stat" | cut -d' ' -f2)
		case "$pid" in '' | *[!0-9]*) return 1 ;; esac
	done
	return 1
}

# PATH with the site's Slurm first (a source build under /opt, a newer release than the system's):
# SLURM_BIN's directories, else the bin and sbin beside the running slurmd; each must be a directory
# of root's that others cannot write (root runs what it finds there). SLURM_CONF, when set, is exported.
use_site_slurm() {
	local dirs=$SLURM_BIN daemon d found="" list
	if [ -z "$dirs" ] && daemon=$(slurmd_exe); then
		dirs="${daemon%/*/*}/bin:${daemon%/*}"
	fi
	IFS=: read -r -a list <<<"$dirs"
	for d in "${list[@]}"; do
		[ -n "$d" ] || continue
		case ":$SYSTEM_PATH:$found" in *":$d:"*) continue ;; esac
		if case "$d" in /*) false ;; *) true ;; esac || [ -L "$d" ] || [ ! -d "$d" ] ||
			[ "$(stat -c %u -- "$d")" != 0 ] || [ $((8#$(stat -c %a -- "$d") & 8#022)) != 0 ]; then
			log "ignoring Slurm directory $d: not an absolute path to a directory of root's that others cannot write"
			continue
		fi
		found="$found$d:"
	done
	PATH="$found$SYSTEM_PATH"
	export PATH
	if [ -n "$SLURM_CONF" ]; then export SLURM_CONF; fi
}

# The job's ids must be numbers and the node name a plain word; 1 when they are not.
job_ids_ok() {
	local id
	for id in "${SLURM_JOB_ID:-}" "${SLURM_JOB_UID:-}" "${SLURM_JOB_GID:-}"; do
		case "$id" in *[!0-9]* | '') return 1 ;; esac
	done
	SLURMD_NODENAME=$(plain_node_name "${SLURMD_NODENAME:-}")
}

# $1 when it is a plain word fit for a path (megatrace/names.py SAFE_CHARS; not . nor ..), else the short
# host name; printed.
plain_node_name() {
	case "$1" in
	*[!A-Za-z0-9._-]* | '' | . | ..) hostname -s ;;
	*) printf '%s' "$1" ;;
	esac
}

as_user() { setpriv --reuid="$SLURM_JOB_UID" --regid="$SLURM_JOB_GID" --init-groups -- "$@"; }

# A base directory root may work in: absent, or a real directory owned by root.
root_base() {
	[ ! -e "$1" ] && [ ! -L "$1" ] && return 0
	[ ! -L "$1" ] && [ -d "$1" ] && [ "$(stat -c %u -- "$1")" = 0 ]
}

# Make base $1 when absent: root's, mode 0755, so that nobody else can make a name in it. 1 when the
# base is not root's (a user made it first): nothing is made in it.
make_base() {
	if ! root_base "$1"; then
		log "$1 is not a root-owned directory: not using it (remove it)"
		return 1
	fi
	[ -d "$1" ] || mkdir -m 0755 -- "$1" 2>/dev/null || [ -d "$1" ] || { log "cannot create $1"; return 1; }
	root_base "$1"
}

# $1/$2 as a directory of the job's user, mode 0700, made by root. Made under a temporary name and
# renamed into place: rename never follows a link nor replaces what is not an empty directory. In a
# base others can write (an old 1777 one) a planted entry is removed and the name made again; a user
# who keeps planting it can at most leave the job untraced, never have a directory of theirs used.
make_user_dir() {
	local path="$1/$2" tmp _
	for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
		if [ -d "$path" ] && [ ! -L "$path" ] && [ "$(stat -c %u:%a -- "$path")" = "$SLURM_JOB_UID:700" ]; then
			return 0
		fi
		if [ -e "$path" ] || [ -L "$path" ]; then
			rm -rf -- "$path" # a leftover, or a planted one: rm never follows links
		fi
		tmp=$(mktemp -d -p "$1" ".$2.XXXXXX") || return 1 # root's, mode 0700
		if chown -- "$SLURM_JOB_UID:$SLURM_JOB_GID" "$tmp" && mv -T -- "$tmp" "$path" 2>/dev/null; then
			continue # checked at the top
		fi
		rm -rf -- "$tmp"
	done
	return 1
}

# Whether $1 may hold the job's files: a real directory of the job's user that others cannot write, in a
# parent that only root or the user own and others cannot write unless it is sticky. (stat never follows
# the last component; the check itself changes nothing.)
user_dir_ok() {
	local parent meta
	[ -d "$1" ] && [ ! -L "$1" ] || return 1
	meta=$(stat -c %u:%a -- "$1") || return 1
	[ "${meta%%:*}" = "$SLURM_JOB_UID" ] && [ $((8#${meta#*:} & 8#022)) = 0 ] || return 1
	parent=$(dirname -- "$1")
	meta=$(stat -L -c %u:%a -- "$parent") || return 1
	case "${meta%%:*}" in 0 | "$SLURM_JOB_UID") ;; *) return 1 ;; esac
	[ $((8#${meta#*:} & 8#002)) = 0 ] || [ $((8#${meta#*:} & 8#1000)) != 0 ]
}

# The job directory to write into, printed: $1, made by the job's user when absent, if user_dir_ok;
# else the fallback <FALLBACK_DIR>/<uid>/megatrace-<jobid> (in the user's own directory that root made).
usable_job_dir() {
	local fallback="$FALLBACK_DIR/$SLURM_JOB_UID/megatrace-$SLURM_JOB_ID"
	as_user mkdir -p -- "$1" 2>/dev/null
	if user_dir_ok "$1" && as_user test -w "$1"; then
		printf '%s' "$1"
		return 0
	fi
	log "job directory $1 is not the job's user's own, or others can change it; using $fallback"
	as_user mkdir -m 0700 -p -- "$fallback" 2>/dev/null || log "cannot create $fallback"
	printf '%s' "$fallback"
}

# The raw value of KEY in SPANK_MEGATRACE_OPTS (only ever used as an argument, as the user).
opt_value() {
	local key=$1 item
	local IFS=,
	for item in ${SPANK_MEGATRACE_OPTS:-}; do
		case "$item" in "$key="*) printf '%s' "${item#"$key="}"; return 0 ;; esac
	done
	return 1
}

# The job's working directory as Slurm has it: squeue prints that one field alone, whole (a WorkDir with
# blanks included); `scontrol show job` output is never split on blanks.
work_dir() { squeue -h -j "$SLURM_JOB_ID" -o %Z 2>/dev/null | head -n 1; }

# The job directory as the plugin computes it: dir= (absolute, or relative to the submit directory),
# else <submit dir>/megatrace-<jobid>.
job_dir_of() {
	local submit=${SPANK_MEGATRACE_SUBMIT_DIR:-} dir
	[ -n "$submit" ] || submit=$(work_dir)
	dir=$(opt_value dir) || dir=""
	case "$dir" in
	/*) printf '%s' "$dir" ;;
	'') printf '%s' "${submit:-/nonexistent}/megatrace-$SLURM_JOB_ID" ;;
	*) printf '%s' "${submit:-/nonexistent}/$dir" ;;
	esac
}
