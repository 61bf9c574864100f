#!/usr/bin/env bash
# A single-node SLURM cluster and an MLflow tracking server on PostgreSQL, on this machine, from Debian's
# packages: sweeps through hydra/launcher=slurm|per_gpu (one job per GPU: SLURM's GRES) into tracking=server.
#
#   scripts/cluster.sh install              the Debian packages (root; apt-get update first)
#   scripts/cluster.sh up [options]         start what is not running; the last line is MLFLOW_TRACKING_URI=...
#   scripts/cluster.sh status [--dir DIR]   what runs; exit 0 when all of it does, 3 when none does
#   scripts/cluster.sh down [--dir DIR]     stop what up started (jobs cancelled first); fails if any of it is left
#   scripts/cluster.sh overhead [N] [--dir DIR]   SLURM's overhead: N trivial jobs one by one, then as one array
#   scripts/cluster.sh fetch DEBDIR         download (apt-get download; root) into DEBDIR the .deb files of SLURM,
#                                           munge and MariaDB for a host without apt or network (no PostgreSQL)
#   scripts/cluster.sh unpack DEBDIR P      dpkg -x every .deb of DEBDIR under the prefix P (nothing goes into /)
#
# up options:
#   --dir DIR          state: configs, databases, logs, artifacts (default: <repo>/.cluster)
#   --host ADDR        address the MLflow server binds (default 127.0.0.1; 0.0.0.0 only if you mean it)
#   --port N           MLflow server port (default 5000)
#   --workers N        MLflow server worker processes (default 4)
#   --python PY        the Python with mlflow and psycopg (pip install -e ".[cluster]"; default: python on PATH)
#   --fake-gpus N      declare N fake GPUs (character devices like /dev/null) instead of /dev/nvidia[0-9]*:
#                      for testing the one-job-per-GPU pinning on a machine without GPUs
#   --prefix P         SLURM, munge and MariaDB from the packages `unpack` put under P, not the system's
#   --no-tracking      no PostgreSQL and no MLflow server: the runs go into an SQLite file, DIR/mlflow.db
#   --port-offset N    add N to the daemons' ports (MariaDB, slurmctld/slurmd/slurmdbd, PostgreSQL): a second
#                      cluster beside another one
#
# What runs (everything on 127.0.0.1 but the MLflow server, which binds --host):
#   munged (socket in DIR/munge), MariaDB :3307 + slurmdbd :6819 (SLURM's accounting: sacct, which
#   submitit reads to see a job end), slurmctld :6817, slurmd :6818 (one node, partition `nsa`, this host's
#   CPUs, memory and GPUs as GRES gpu), PostgreSQL :5433 (role `mlflow`, databases `mlflow` and
#   `mlflow_auth`), and `mlflow server` on PostgreSQL with MLflow's basic-auth app and artifacts proxied
#   into DIR/artifacts (0700).
# The MLflow server refuses requests without a login: user `admin`, password generated into
#   DIR/mlflow-admin.password; DIR/mlflow/credentials holds both in the format of MLflow's credentials
#   file with the server they belong to (mlflow_tracking_uri). The experiments send that login to that
#   server only (tracking=server reads .cluster/mlflow/credentials of the launch directory; elsewhere
#   tracking.credentials=DIR/mlflow/credentials). Nothing global: no ~/.mlflow/credentials, which MLflow
#   would send to every http tracking URI (a link an earlier version made is removed by up and down).
#   Non-admin users get READ on what others logged (default_permission). Every password is in a 0600
#   file of DIR and reaches the databases through stdin or a file, never a command line.
# The SLURM clients (sbatch, squeue, sacct) find the cluster through /etc/slurm/slurm.conf, a link to
# DIR/slurm/slurm.conf made while the cluster is up (only where that path is free or already such a link).
# `up` records each daemon's pid and start time (DIR/pids); `down` stops only processes whose start time
# still matches, and fails only on those and on this cluster's job steps (slurmstepd of its slurmd).
#
# On a host without apt or network (the packages are Debian 12's; they run on Ubuntu 24.04 too), as root:
#   scripts/cluster.sh fetch .debs                  (on a Debian 12 machine with apt: 14 MiB)
#   scripts/cluster.sh unpack .debs /tmp/slurm      (on the host: nothing is installed into /)
#   scripts/cluster.sh up --prefix /tmp/slurm --no-tracking --dir /tmp/cl
#   . /tmp/cl/slurm.env && python -m experiments.decode -m hydra/launcher=per_gpu tracking.uri=sqlite:////tmp/cl/mlflow.db ...
#   scripts/cluster.sh down --dir /tmp/cl
# With --prefix, /etc is left alone: the daemons get P's binaries, plugins (PluginDir), libraries and
# MariaDB's share files from `up`, and the clients theirs from DIR/slurm.env, which the sweep's shell
# sources: PATH (P's bin and sbin first), LD_LIBRARY_PATH (SLURM's private library, and DIR/lib: links to
# those of P's shared libraries whose name the system's own (ldconfig -p) lacks, so a library the host
# has is never replaced, in the sweep's Python neither) and SLURM_CONF. sbatch passes that environment
# on to the jobs, and so to the srun and Python in them. A missing `mysql` user (MariaDB's) is created
# (useradd --system); munged runs as root, as without --prefix. DIR must be reachable by user mysql
# (/tmp/cl is; a folder under /root is not).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PARTITION=nsa
ETC_SLURM_CONF=/etc/slurm/slurm.conf
DEBIAN_PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server postgresql)
# What `fetch` downloads: the daemons and clients (SLURM's plugins, its MySQL plugin, MariaDB's server and
# client cores: not mariadb-server, whose scripts need perl, galera, rsync, ...), and the libraries they
# link that a minimal Ubuntu 24.04 may lack (libaio1: Ubuntu's libaio1t64 is libaio.so.1t64). Left out:
# what every Debian or Ubuntu has (libc6, libgcc-s1, libstdc++6, zlib1g, libpam0g, libsystemd0, libudev1,
# libpcre2-8-0, libcrypt1, liblz4-1, libgcrypt20, libbz2-1.0, libtinfo6, libmd0, ...), PostgreSQL, and
# what only plugins this cluster does not load link (lua, pmix, rrd, ...). libdbus-1-3 stays: slurmd loads
# the cgroup/v2 plugin, which links it, on a host with the unified cgroup hierarchy (the GPU boxes).
FETCH_PACKAGES=(munge libmunge2 slurmctld slurmd slurm-client slurmdbd slurm-wlm-basic-plugins
    slurm-wlm-mysql-plugin mariadb-server-core mariadb-client-core libmariadb3
    libaio1 liburing2 libnuma1 libhwloc15 libreadline8 libedit2 libbsd0 libncurses6 libssl3 libjson-c5 libyaml-0-2 libdbus-1-3)

die() { echo "cluster: $*" >&2; exit 2; }
say() { echo "cluster: $*"; }

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

# ---------------------------------------------------------------- fetch, unpack: packages for a host without apt
candidates() {  # "package version architecture" of each of FETCH_PACKAGES that apt knows
    apt-cache show --no-all-versions "${FETCH_PACKAGES[@]}" 2>/dev/null \
        | awk '/^Package: / { p = $2 } /^Version: / { v = $2 } /^Architecture: / { a = $2 } /^$/ && p { print p, v, a; p = "" }
               END { if (p) print p, v, a }'
}

cmd_fetch() {  # cmd_fetch DEBDIR: FETCH_PACKAGES' candidate versions, from apt's cache where it holds them
    local dest=$1 p found ver arch name total
    [ "$(id -u)" -eq 0 ] || die "fetch needs root (apt-get download, apt-get update)"
    command -v apt-get > /dev/null || die "fetch needs apt-get (a Debian 12 machine)"
    mkdir -p "$dest" 2>/dev/null || die "cannot create $dest"
    found=$(candidates)
    if [ "$(wc -l <<< "$found")" -ne ${#FETCH_PACKAGES[@]} ]; then
        apt-get update -qq || die "apt-get update failed"
        found=$(candidates)
    fi
    declare -A want=()
    for p in "${FETCH_PACKAGES[@]}"; do
        read -r _ ver arch <<< "$(grep "^$p " <<< "$found" | head -1)"
        [ -n "${arch:-}" ] || die "apt knows no package $p"
        name="${p}_${ver//:/%3a}_${arch}.deb"  # how apt names the file (the epoch's colon as %3a)
        want[$name]=1
        if [ -s "$dest/$name" ]; then
            :
        elif [ -s "/var/cache/apt/archives/$name" ]; then
            cp "/var/cache/apt/archives/$name" "$dest/"
        else
            (cd "$dest" && apt-get download -qq "$p=$ver" 2>&1 | grep -v "unsandboxed as root" >&2) || true
            [ -s "$dest/$name" ] || die "apt-get download $p=$ver failed"
        fi
    done
    for p in "$dest"/*.deb; do
        [ -e "$p" ] && [ -z "${want[$(basename "$p")]:-}" ] && die "$dest holds $(basename "$p"), which is none of the packages: give an empty folder"
    done
    total=$(du -cb "$dest"/*.deb | tail -1 | cut -f1)
    say "fetched ${#want[@]} packages into $dest: $(awk -v b="$total" 'BEGIN { printf "%.1f MiB", b / 1048576 }') ($total bytes)"
}

cmd_unpack() {  # cmd_unpack DEBDIR P: dpkg -x each package under P; SLURM's daemons under their plain names
    local debs=$1 prefix=$2 f n=0 b
    command -v dpkg > /dev/null || die "unpack needs dpkg"
    compgen -G "$debs/*.deb" > /dev/null || die "no .deb files in $debs (scripts/cluster.sh fetch $debs)"
    mkdir -p "$prefix" 2>/dev/null || die "cannot create $prefix"
    for f in "$debs"/*.deb; do
        dpkg -x "$f" "$prefix" || die "dpkg -x $f failed"
        n=$((n + 1))
    done
    # Debian installs slurmctld-wlm (...) and points slurmctld at it through update-alternatives, in its
    # postinst, which dpkg -x does not run; slurmd runs the slurmstepd beside it.
    for b in slurmctld slurmd slurmstepd; do
        [ -e "$prefix/usr/sbin/$b-wlm" ] && ln -sfn "$b-wlm" "$prefix/usr/sbin/$b"
    done
    say "unpacked $n packages into $prefix ($(du -sh "$prefix" | cut -f1)): scripts/cluster.sh up --prefix $prefix --no-tracking --dir DIR"
}

# ---------------------------------------------------------------- options and saved settings
CMD=${1:-}
[ -n "$CMD" ] || { usage; exit 2; }
case "$CMD" in -h|--help|help) usage; exit 0 ;; esac
shift
case "$CMD" in
    fetch)
        [ $# -eq 1 ] && [ "${1:0:1}" != - ] || die "usage: scripts/cluster.sh fetch DEBDIR"
        cmd_fetch "$1"; exit 0 ;;
    unpack)
        [ $# -eq 2 ] && [ "${1:0:1}" != - ] && [ "${2:0:1}" != - ] || die "usage: scripts/cluster.sh unpack DEBDIR PREFIX"
        cmd_unpack "$1" "$2"; exit 0 ;;
esac
DIR=$REPO/.cluster
HOST= PORT= WORKERS= PY= FAKE_GPUS= N_OVERHEAD= PREFIX= NO_TRACKING= PORT_OFFSET=
while [ $# -gt 0 ]; do
    case "$1" in
        --dir) DIR=${2:?--dir needs a directory}; shift 2 ;;
        --host) HOST=${2:?--host needs an address}; shift 2 ;;
        --port) PORT=${2:?--port needs a number}; shift 2 ;;
        --workers) WORKERS=${2:?--workers needs a number}; shift 2 ;;
        --python) PY=${2:?--python needs a path}; shift 2 ;;
        --fake-gpus) FAKE_GPUS=${2:?--fake-gpus needs a number}; shift 2 ;;
        --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
        --no-tracking) NO_TRACKING=1; shift ;;
        --port-offset) PORT_OFFSET=${2:?--port-offset needs a number}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        [0-9]*) [ "$CMD" = overhead ] || die "unexpected argument '$1'"; N_OVERHEAD=$1; shift ;;
        *) die "unknown option '$1' (scripts/cluster.sh --help)" ;;
    esac
done
for v in PORT WORKERS FAKE_GPUS N_OVERHEAD PORT_OFFSET; do
    [ -z "${!v}" ] || [[ "${!v}" =~ ^[0-9]+$ ]] || die "--$(echo "$v" | tr 'A-Z_' 'a-z-') must be a whole number, got '${!v}'"
done
mkdir -p "$DIR" 2>/dev/null || die "cannot create the state directory $DIR"
DIR=$(cd "$DIR" && pwd)
SETTINGS=$DIR/cluster.env
SLURM_CONF_FILE=$DIR/slurm/slurm.conf
export SLURM_CONF=$SLURM_CONF_FILE

# The settings of the last `up` (host, port, workers, python, fake GPUs, prefix, no tracking, port offset)
# are kept in DIR/cluster.env, so that status/down/up-again see the cluster as it was started.
saved() { [ ! -f "$SETTINGS" ] || sed -n "s/^$1=//p" "$SETTINGS" | tail -1; }

pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }
port_busy() {  # a TCP socket listens on port $1 (ss; where iproute2 is missing, /proc/net/tcp*: 0A is LISTEN)
    if command -v ss > /dev/null; then ss -Hltn "sport = :$1" | grep -q .; return; fi
    awk -v p="$(printf '%04X' "$1")" '$4 == "0A" && toupper(substr($2, length($2) - 3)) == p { f = 1 } END { exit !f }' \
        /proc/net/tcp /proc/net/tcp6 2>/dev/null
}
pids_named() {  # the pids of the processes whose name (comm) is $1: pgrep -x, or /proc where procps is missing
    if command -v pgrep > /dev/null; then pgrep -x "$1" || true; return 0; fi
    local f c
    for f in /proc/[0-9]*/comm; do
        { read -r c < "$f"; } 2>/dev/null && [ "$c" = "$1" ] && { f=${f%/comm}; echo "${f#/proc/}"; }
    done
    return 0
}

PG_PORT= DB_PORT= CTLD_PORT= SLURMD_PORT= DBD_PORT= SLURM_LIBDIR= MARIADB_OPTS=()
apply_settings() {  # the ports, the services and, with a prefix, where SLURM, munge and MariaDB are
    local o=${PORT_OFFSET:-0}
    PG_PORT=$((5433 + o)) DB_PORT=$((3307 + o)) CTLD_PORT=$((6817 + o)) SLURMD_PORT=$((6818 + o)) DBD_PORT=$((6819 + o))
    [ -z "$NO_TRACKING" ] || SERVICES=(munged mariadbd slurmdbd slurmctld slurmd)
    [ -n "$PREFIX" ] || return 0
    SLURM_LIBDIR=$(ls -d "$PREFIX"/usr/lib/*/slurm-wlm 2>/dev/null | head -1)
    SLURM_LIBDIR=${SLURM_LIBDIR:-$PREFIX/usr/lib/x86_64-linux-gnu/slurm-wlm}
    export PATH="$PREFIX/usr/sbin:$PREFIX/usr/bin:$PATH"
    export LD_LIBRARY_PATH="$DIR/lib:$SLURM_LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    MARIADB_OPTS=(--basedir="$PREFIX/usr" --lc-messages-dir="$PREFIX/usr/share/mysql"
        --character-sets-dir="$PREFIX/usr/share/mysql/charsets" --plugin-dir="$PREFIX/usr/lib/mysql/plugin")
}

link_prefix_libs() {  # DIR/lib: links to those of P's shared libraries whose name the system's (ldconfig -p)
    # lacks; the system's own are used where it has them (newer, and never two copies in one process)
    local have f n=0
    have=$(ldconfig -p 2>/dev/null | awk 'NR > 1 { print $1 }' || true)
    rm -rf "$DIR/lib"
    install -d "$DIR/lib"
    for f in "$PREFIX"/usr/lib/*/lib*.so.* "$PREFIX"/lib/*/lib*.so.*; do
        [[ "$f" =~ \.so\.[0-9]+$ ]] || continue  # a library's name (libaio.so.1), not its file's (libaio.so.1.0.2)
        grep -qxF "$(basename "$f")" <<< "$have" && continue
        ln -sfn "$f" "$DIR/lib/"
        n=$((n + 1))
    done
    echo "$n"
}

write_env_file() {  # what a sweep's shell sources to reach this cluster with P's clients
    cat > "$DIR/slurm.env" <<EOF
# written by scripts/cluster.sh: SLURM's clients (sbatch, squeue, sacct, scancel, srun) from $PREFIX for the
# cluster of $DIR; source it in the sweep's shell (sbatch passes it on to the jobs)
export PATH="$PREFIX/usr/bin:$PREFIX/usr/sbin:\$PATH"
export LD_LIBRARY_PATH="$DIR/lib:$SLURM_LIBDIR\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export SLURM_CONF="$SLURM_CONF_FILE"
EOF
}

# name -> the pid file the daemon writes itself (the MLflow server's pid is the one `up` started)
declare -A PIDFILE=(
    [munged]=$DIR/munge/munged.pid
    [mariadbd]=$DIR/mariadb/mariadbd.pid
    [slurmdbd]=$DIR/slurm/slurmdbd.pid
    [slurmctld]=$DIR/slurm/slurmctld.pid
    [slurmd]=$DIR/slurm/slurmd.pid
    [postgres]=$DIR/postgres/data/postmaster.pid
)
SERVICES=(munged mariadbd slurmdbd slurmctld slurmd postgres mlflow)
RECORDS=$DIR/pids
MLFLOW_ADMIN=admin
CREDENTIALS=$DIR/mlflow/credentials
HOME_CREDENTIALS=${HOME:+$HOME/.mlflow/credentials}

start_time() {  # start_time PID: field 22 of /proc/PID/stat (clock ticks after boot); fails for no process or a zombie
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }  # the fields after "(comm)", which may itself hold spaces or parentheses
    # shellcheck disable=SC2086  # split into fields on purpose
    set -- $stat
    [ "$1" != Z ] && [ -n "${20:-}" ] || return 1
    echo "${20}"
}

record() {  # record NAME PID [COMM]: NAME is process PID, started by this script (its comm checked if given)
    local st
    st=$(start_time "$2") || die "$1 (pid $2) exited (logs in $DIR)"
    if [ -n "${3:-}" ] && [ "$(cat "/proc/$2/comm" 2>/dev/null)" != "$3" ]; then
        die "$1: pid $2 from its pid file is not $3 (logs in $DIR)"
    fi
    install -d -m 700 "$RECORDS"
    echo "$2 $st" > "$RECORDS/$1"
}

pid_of() {  # the recorded pid of NAME
    local p _st
    { read -r p _st < "$RECORDS/$1"; } 2>/dev/null && [ -n "$p" ] && echo "$p"
}
running() {  # NAME's recorded process is alive with its recorded start time (not a reused pid)
    local p st
    { read -r p st < "$RECORDS/$1"; } 2>/dev/null && [ -n "$p" ] || return 1
    [ "$(start_time "$p")" = "$st" ]
}
record_from_pidfile() {  # record_from_pidfile NAME COMM: the daemon's own pid file (first line) names it
    local p
    p=$(head -1 "${PIDFILE[$1]}" 2>/dev/null) && [ -n "$p" ] || die "$1 wrote no pid file ${PIDFILE[$1]}"
    record "$1" "$p" "$2"
}

wait_for() {  # wait_for SECONDS WHAT [--pid SERVICE] COMMAND...: poll every 0.2 s (and stop if SERVICE exits)
    local t=$1 what=$2 service=; shift 2
    [ "$1" = --pid ] && { service=$2; shift 2; }
    local end=$((SECONDS + t))
    until "$@" >/dev/null 2>&1; do
        [ -z "$service" ] || running "$service" || die "$what exited (logs in $DIR)"
        [ $SECONDS -lt $end ] || die "$what did not come up within ${t}s (logs in $DIR)"
        sleep 0.2
    done
}

secret() {  # secret FILE: a random password kept in FILE (0600)
    [ -s "$1" ] || (umask 077 && head -c 24 /dev/urandom | base64 | tr -d '/+=' > "$1")
    chmod 600 "$1"
    cat "$1"
}

# ---------------------------------------------------------------- services
start_munge() {
    running munged && return
    install -d -m 711 "$DIR/munge"
    install -d -m 700 "$DIR/munge/private"
    [ -s "$DIR/munge/private/munge.key" ] || (umask 077 && head -c 128 /dev/urandom > "$DIR/munge/private/munge.key")
    chmod 400 "$DIR/munge/private/munge.key"
    munged --key-file="$DIR/munge/private/munge.key" --socket="$DIR/munge/munge.socket.2" \
        --pid-file="${PIDFILE[munged]}" --log-file="$DIR/munge/private/munged.log" \
        --seed-file="$DIR/munge/private/munged.seed" \
        || die "munged failed: $(tail -2 "$DIR/munge/private/munged.log" 2>/dev/null)"
    wait_for 10 munged test -S "$DIR/munge/munge.socket.2"
    record_from_pidfile munged munged
}

# SQL on stdin (a here-document: never an argument, so a password in it is not on a command line)
mariadb_sql() { mariadb --no-defaults --socket="$DIR/mariadb/mysqld.sock" -u root --batch; }
mariadb_ping() { echo "SELECT 1" | mariadb_sql; }

start_mariadb() {
    running mariadbd && return
    port_busy "$DB_PORT" && die "port $DB_PORT (MariaDB, SLURM's accounting) is taken by another program"
    install -d -o mysql -g mysql -m 700 "$DIR/mariadb"
    if [ ! -d "$DIR/mariadb/data/mysql" ]; then
        mariadb-install-db --no-defaults ${PREFIX:+--basedir="$PREFIX/usr"} --datadir="$DIR/mariadb/data" --user=mysql --skip-test-db \
            --auth-root-authentication-method=socket > "$DIR/mariadb/install.log" 2>&1 \
            || die "mariadb-install-db failed (see $DIR/mariadb/install.log)"
    fi
    setsid mariadbd --no-defaults "${MARIADB_OPTS[@]}" --user=mysql --datadir="$DIR/mariadb/data" \
        --socket="$DIR/mariadb/mysqld.sock" --pid-file="${PIDFILE[mariadbd]}" \
        --bind-address=127.0.0.1 --port="$DB_PORT" --skip-name-resolve \
        --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 \
        --log-error="$DIR/mariadb/error.log" < /dev/null > /dev/null 2>&1 &
    record mariadbd $!  # setsid execs mariadbd in this process: $! is mariadbd
    wait_for 60 MariaDB --pid mariadbd test -S "$DIR/mariadb/mysqld.sock"
    wait_for 30 MariaDB --pid mariadbd mariadb_ping
}

provision_mariadb() {  # SLURM's accounting user, its password that of DIR/slurm/db.password (set on every up)
    local pw; pw=$(secret "$DIR/slurm/db.password")
    mariadb_sql <<EOF
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pw';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
}

write_slurm_conf() {
    local node cpus mem_mb gres="" devices=()
    node=$(hostname -s)
    cpus=$(nproc)
    mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
    if [ -n "$FAKE_GPUS" ] && [ "$FAKE_GPUS" -gt 0 ]; then
        install -d "$DIR/dev"
        for ((i = 0; i < FAKE_GPUS; i++)); do
            [ -c "$DIR/dev/nvidia$i" ] || mknod "$DIR/dev/nvidia$i" c 1 3  # the device numbers of /dev/null
            devices+=("$DIR/dev/nvidia$i")
        done
    elif [ -z "$FAKE_GPUS" ]; then
        for d in /dev/nvidia[0-9]*; do [ -c "$d" ] && devices+=("$d"); done
    fi
    {
        echo "# written by scripts/cluster.sh: one node ($node), GRES gpu = ${devices[*]:-none}"
        for d in "${devices[@]}"; do echo "NodeName=$node Name=gpu File=$d"; done
    } > "$DIR/slurm/gres.conf"
    [ ${#devices[@]} -gt 0 ] && gres="Gres=gpu:${#devices[@]}"
    cat > "$SLURM_CONF_FILE" <<EOF
# written by scripts/cluster.sh (state in $DIR): a single-node cluster on 127.0.0.1
ClusterName=nsa
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
# bind 127.0.0.1 (NodeAddr, SlurmctldHost) instead of every address
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
StateSaveLocation=$DIR/slurm/state
SlurmdSpoolDir=$DIR/slurm/spool
SlurmctldPidFile=${PIDFILE[slurmctld]}
SlurmdPidFile=${PIDFILE[slurmd]}
SlurmctldLogFile=$DIR/slurm/log/slurmctld.log
SlurmdLogFile=$DIR/slurm/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
# start a job as soon as resources free up (the default waits up to 3 s to batch scheduling)
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$((mem_mb / cpus))
ReturnToService=2
JobCompType=jobcomp/none
MailProg=/bin/true
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# for slurmdbd, the "password" is the munge socket
AccountingStoragePass=$DIR/munge/munge.socket.2
AccountingStorageTRES=gres/gpu
GresTypes=gpu
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb $gres State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    [ -z "$PREFIX" ] || sed -i "/^ClusterName=/a PluginDir=$SLURM_LIBDIR" "$SLURM_CONF_FILE"
    # slurmd loads a cgroup plugin at start even with proctrack/linuxproc and task/none. On a unified (v2)
    # hierarchy without systemd as init (containers, the GPU boxes' VMs), cgroup/v2 cannot ask systemd for
    # its scope over D-Bus: it makes the cgroup itself when told it may.
    cat > "$DIR/slurm/cgroup.conf" <<EOF
# written by scripts/cluster.sh
CgroupPlugin=autodetect
IgnoreSystemdOnFailure=yes
EOF
    (umask 077 && cat > "$DIR/slurm/slurmdbd.conf" <<EOF
# written by scripts/cluster.sh: SLURM's accounting in MariaDB on 127.0.0.1:$DB_PORT
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
DbdAddr=127.0.0.1
DbdHost=localhost
CommunicationParameters=NoInAddrAny
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=${PIDFILE[slurmdbd]}
LogFile=$DIR/slurm/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$DIR/slurm/db.password")
StorageLoc=slurm_acct_db
EOF
    )
    [ -z "$PREFIX" ] || echo "PluginDir=$SLURM_LIBDIR" >> "$DIR/slurm/slurmdbd.conf"
}

link_etc_slurm_conf() {
    if [ -L "$ETC_SLURM_CONF" ] || [ ! -e "$ETC_SLURM_CONF" ]; then
        local target; target=$(readlink "$ETC_SLURM_CONF" 2>/dev/null || true)
        if [ -n "$target" ] && [ "$target" != "$SLURM_CONF_FILE" ] && [ -e "$target" ] \
            && grep -q "written by scripts/cluster.sh" "$target" \
            && [ -f "$(dirname "$target")/slurmctld.pid" ] && kill -0 "$(cat "$(dirname "$target")/slurmctld.pid")" 2>/dev/null; then
            die "another cluster is up ($target): scripts/cluster.sh down --dir $(dirname "$(dirname "$target")")"
        fi
        install -d "$(dirname "$ETC_SLURM_CONF")"
        ln -sfn "$SLURM_CONF_FILE" "$ETC_SLURM_CONF"
    else
        say "$ETC_SLURM_CONF is this host's own: SLURM's clients need SLURM_CONF=$SLURM_CONF_FILE"
    fi
}

start_slurm() {
    install -d "$DIR/slurm/state" "$DIR/slurm/spool" "$DIR/slurm/log"
    secret "$DIR/slurm/db.password" > /dev/null
    running slurmctld || write_slurm_conf
    if [ -n "$PREFIX" ]; then
        write_env_file  # /etc is left alone: the clients get SLURM_CONF from DIR/slurm.env
    else
        link_etc_slurm_conf
    fi
    start_mariadb
    provision_mariadb
    if ! running slurmdbd; then
        port_busy "$DBD_PORT" && die "port $DBD_PORT (slurmdbd) is taken by another program"
        slurmdbd || die "slurmdbd failed: $(tail -3 "$DIR/slurm/log/slurmdbd.log" 2>/dev/null)"
        wait_for 60 slurmdbd port_busy "$DBD_PORT"
        record_from_pidfile slurmdbd slurmdbd
    fi
    if ! running slurmctld; then
        port_busy "$CTLD_PORT" && die "port $CTLD_PORT (slurmctld) is taken by another program"
        slurmctld -f "$SLURM_CONF_FILE" || die "slurmctld failed: $(tail -3 "$DIR/slurm/log/slurmctld.log" 2>/dev/null)"
        wait_for 60 slurmctld scontrol ping
        record_from_pidfile slurmctld slurmctld
    fi
    local new_slurmd=0
    if ! running slurmd; then
        port_busy "$SLURMD_PORT" && die "port $SLURMD_PORT (slurmd) is taken by another program"
        prepare_cgroup_v2
        # slurmd runs the slurmstepd of its build (/usr/sbin) unless told which: P's
        slurmd -f "$SLURM_CONF_FILE" ${PREFIX:+-d "$PREFIX/usr/sbin/slurmstepd"} || die "slurmd failed: $(tail -3 "$DIR/slurm/log/slurmd.log" 2>/dev/null)"
        new_slurmd=1
    fi
    wait_for 60 "the SLURM node" node_ready
    [ "$new_slurmd" = 0 ] || record_from_pidfile slurmd slurmd
}

# slurmd's cgroup/v2 plugin, on a unified hierarchy without systemd as init (the GPU boxes' VMs, containers),
# makes slurmstepd's scope itself (cgroup.conf: IgnoreSystemdOnFailure) under /sys/fs/cgroup/system.slice,
# which only systemd would have made, and wants the cpuset, cpu and memory controllers enabled below the root.
prepare_cgroup_v2() {
    [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ] || return 0
    [ "$(cat /proc/1/comm 2>/dev/null)" != systemd ] || return 0
    local c
    install -d /sys/fs/cgroup/system.slice
    for c in cpuset cpu memory; do
        echo "+$c" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
        echo "+$c" > /sys/fs/cgroup/system.slice/cgroup.subtree_control 2>/dev/null || true
    done
    say "cgroup v2 without systemd: /sys/fs/cgroup/system.slice made, controllers" \
        "$(cat /sys/fs/cgroup/system.slice/cgroup.subtree_control 2>/dev/null) enabled there"
}

node_ready() { sinfo -h -N -o '%T' | grep -q -E '^(idle|mixed|allocated)'; }

pg() { runuser -u postgres -- "$(pg_bin)/$1" "${@:2}"; }
# SQL on stdin, as for MariaDB
psql_admin() { runuser -u postgres -- psql -X -q -h "$DIR/postgres" -p "$PG_PORT" -d postgres -v ON_ERROR_STOP=1 "$@"; }

start_postgres() {
    running postgres && return
    port_busy "$PG_PORT" && die "port $PG_PORT (PostgreSQL) is taken by another program"
    install -d -o postgres -g postgres -m 700 "$DIR/postgres"
    if [ ! -f "$DIR/postgres/data/PG_VERSION" ]; then
        pg initdb -D "$DIR/postgres/data" -U postgres --auth-local=peer --auth-host=scram-sha-256 \
            > "$DIR/postgres/initdb.log" 2>&1 || die "initdb failed (see $DIR/postgres/initdb.log)"
    fi
    pg pg_ctl -D "$DIR/postgres/data" -l "$DIR/postgres/postgres.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $PG_PORT -k $DIR/postgres -c max_connections=200" start > /dev/null \
        || die "PostgreSQL failed: $(tail -3 "$DIR/postgres/postgres.log")"
    record_from_pidfile postgres postgres
}

provision_postgres() {  # role mlflow (password of DIR/mlflow.pgpassword, set on every up), its two databases:
    # the tracking store and the basic-auth app's users and permissions
    local pw; pw=$(secret "$DIR/mlflow.pgpassword")
    psql_admin <<EOF
SELECT 'CREATE ROLE mlflow LOGIN' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mlflow') \gexec
ALTER ROLE mlflow LOGIN PASSWORD '$pw';
SELECT 'CREATE DATABASE mlflow OWNER mlflow' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'mlflow') \gexec
SELECT 'CREATE DATABASE mlflow_auth OWNER mlflow' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'mlflow_auth') \gexec
EOF
}

write_mlflow_files() {  # the server's and its clients' secrets, each 0600 in DIR/mlflow (0700)
    install -d -m 700 "$DIR/mlflow"
    local admin_pw; admin_pw=$(secret "$DIR/mlflow-admin.password")
    secret "$DIR/mlflow/flask.secret" > /dev/null
    (
        umask 077
        echo "127.0.0.1:$PG_PORT:*:mlflow:$(cat "$DIR/mlflow.pgpassword")" > "$DIR/mlflow/pgpass"
        # MLflow's basic-auth app (mlflow/server/auth/basic_auth.ini): users and permissions in PostgreSQL;
        # the admin is created with this password on the first start (later starts keep the stored one).
        # A user other than the admin reads every experiment and run and changes only its own.
        # A login checked is remembered for 60 s by each worker: the check (PBKDF2, 10^6 rounds) costs
        # ~0.6 s of CPU here, on every request otherwise; a password changed or a user deleted through
        # the API may still be let in by another worker for up to that long.
        cat > "$DIR/mlflow/basic_auth.ini" <<EOF
[mlflow]
default_permission = READ
database_uri = postgresql+psycopg://mlflow@127.0.0.1:$PG_PORT/mlflow_auth
admin_username = $MLFLOW_ADMIN
admin_password = $admin_pw
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = 60
EOF
        cat > "$CREDENTIALS" <<EOF
# written by scripts/cluster.sh: the login to the MLflow server of $DIR (mlflow_tracking_uri) and to no
# other, in the format of MLflow's credentials file: the experiments read it as tracking.credentials
[mlflow]
mlflow_tracking_uri = http://$(uri_host):$PORT
mlflow_tracking_username = $MLFLOW_ADMIN
mlflow_tracking_password = $admin_pw
EOF
    )
    chmod 600 "$DIR/mlflow/pgpass" "$DIR/mlflow/basic_auth.ini" "$CREDENTIALS"
}

unlink_credentials() {  # ~/.mlflow/credentials as a link to a file this script wrote (an earlier version
    # linked it: MLflow then sent the login to every http tracking URI); a user's own file is left as it is
    [ -n "$HOME_CREDENTIALS" ] && [ -L "$HOME_CREDENTIALS" ] || return 0
    local target; target=$(readlink "$HOME_CREDENTIALS")
    if [ "$target" = "$CREDENTIALS" ] || head -1 "$target" 2>/dev/null | grep -q "^# written by scripts/cluster.sh"; then
        rm -f "$HOME_CREDENTIALS"
    fi
}

mlflow_login_ok() {  # the admin's login is accepted (curl reads it from stdin, not from its command line)
    printf 'user = "%s:%s"\n' "$MLFLOW_ADMIN" "$(cat "$DIR/mlflow-admin.password")" \
        | curl -sf -m 10 -K - -o /dev/null "http://$(uri_host):$PORT/api/2.0/mlflow/experiments/search?max_results=1"
}

start_mlflow() {
    write_mlflow_files
    install -d -m 700 "$DIR/artifacts"
    chmod 700 "$DIR/artifacts"  # every run's artifacts: the server's (root's) alone
    if ! running mlflow; then
        port_busy "$PORT" && die "port $PORT (MLflow server) is taken by another program: --port N"
        "$PY" -c "import mlflow, psycopg, flask_wtf" 2>/dev/null \
            || die "$PY cannot import mlflow, psycopg and flask_wtf: pip install -e \".[cluster]\" (or --python PY)"
        # The secrets reach the server through files and its environment, not its command line (ps shows
        # that): libpq reads PGPASSFILE, the auth app MLFLOW_AUTH_CONFIG_PATH, and Flask's CSRF key is
        # MLFLOW_FLASK_SERVER_SECRET_KEY. Telemetry off: a cluster's server has no business calling out
        # (see the README's MLflow part). No job execution: MLflow's server-side GenAI jobs (scorers,
        # trace roll-ups) would add 7 worker processes (~0.8 GB).
        PGPASSFILE=$DIR/mlflow/pgpass MLFLOW_AUTH_CONFIG_PATH=$DIR/mlflow/basic_auth.ini \
            MLFLOW_FLASK_SERVER_SECRET_KEY=$(cat "$DIR/mlflow/flask.secret") \
            MLFLOW_DISABLE_TELEMETRY=true MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false \
            setsid "$PY" -m mlflow server --app-name basic-auth \
            --backend-store-uri "postgresql+psycopg://mlflow@127.0.0.1:$PG_PORT/mlflow" \
            --artifacts-destination "$DIR/artifacts" --serve-artifacts \
            --host "$HOST" --port "$PORT" --workers "$WORKERS" \
            < /dev/null > "$DIR/mlflow/server.log" 2>&1 &
        record mlflow $!  # setsid execs the server in this process
        wait_for 120 "the MLflow server" --pid mlflow curl -sf -m 2 "http://$(uri_host):$PORT/health"
    fi
    mlflow_login_ok || die "the MLflow server refuses user $MLFLOW_ADMIN with the password in" \
        "$DIR/mlflow-admin.password (its users are in PostgreSQL's database mlflow_auth)"
    unlink_credentials
}

uri_host() { [ "$HOST" = 0.0.0.0 ] && echo 127.0.0.1 || echo "$HOST"; }

# ---------------------------------------------------------------- stopping
stop() {  # stop NAME...: SIGTERM to each recorded process (for mlflow its process group: the server and
    # its workers), wait up to 60 s, then SIGKILL what is still that process (or, for mlflow, that group)
    local name p names=()
    for name in "$@"; do
        running "$name" || continue
        p=$(pid_of "$name")
        [ "$name" = mlflow ] && p=-$p
        kill -TERM -- "$p" 2>/dev/null || true
        names+=("$name")
    done
    local end=$((SECONDS + 60))
    for name in "${names[@]}"; do
        while still_up "$name" && [ $SECONDS -lt $end ]; do sleep 0.1; done
        if still_up "$name"; then
            say "$name did not stop within 60s: SIGKILL"
            p=$(pid_of "$name")
            [ "$name" = mlflow ] && p=-$p
            kill -KILL -- "$p" 2>/dev/null || true
        fi
    done
}
still_up() {  # the recorded process; for mlflow also its workers once it is gone: its process group
    # outlives it, and its pid is not given to another process while that group has members
    running "$1" && return 0
    local p
    [ "$1" = mlflow ] && p=$(pid_of mlflow) || return 1
    ! start_time "$p" > /dev/null && kill -0 -- "-$p" 2>/dev/null
}

job_steps() {  # this cluster's job steps: slurmstepd processes that our slurmd started (its SLURM_CONF,
    # inherited; another cluster's slurmd has its own or none)
    local p
    for p in $(pids_named slurmstepd); do
        { tr '\0' '\n' < "/proc/$p/environ"; } 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF_FILE" && echo "$p"
    done
    return 0
}

cmd_down() {
    local t0=$SECONDS end
    if running slurmctld; then
        local jobs; jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ' || true)
        if [ -n "${jobs// /}" ]; then
            say "cancelling jobs $jobs"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            end=$((SECONDS + 60))
            while [ -n "$(squeue -h 2>/dev/null)" ] && [ $SECONDS -lt $end ]; do sleep 0.5; done
        fi
    fi
    end=$((SECONDS + 10))  # a cancelled job's step ends shortly after squeue no longer lists it
    while [ -n "$(job_steps)" ] && [ $SECONDS -lt $end ]; do sleep 0.2; done
    # In three waves, each stopped at once: the clients of a service go before it.
    stop mlflow slurmd slurmctld
    stop postgres slurmdbd  # postgres: SIGTERM is its "smart" shutdown; no client is left
    stop mariadbd munged
    if [ -L "$ETC_SLURM_CONF" ] && [ "$(readlink "$ETC_SLURM_CONF")" = "$SLURM_CONF_FILE" ]; then
        rm -f "$ETC_SLURM_CONF"
    fi
    unlink_credentials
    local left=() s
    for s in "${SERVICES[@]}"; do still_up "$s" && left+=("$s($(pid_of "$s"))"); done
    local steps; steps=$(job_steps | tr '\n' ' ')
    [ -n "${steps// /}" ] && left+=("slurmstepd(${steps% })")
    if [ ${#left[@]} -gt 0 ]; then
        echo "cluster: still running after down: ${left[*]}" >&2
        exit 1
    fi
    rm -f "$SETTINGS"  # no cluster.env: this state directory's cluster is down (tests skip, not fail)
    say "down in $((SECONDS - t0))s: nothing left running"
}

# ---------------------------------------------------------------- status, overhead
cmd_status() {
    local n=0 s
    for s in "${SERVICES[@]}"; do
        if running "$s"; then say "$s running (pid $(pid_of "$s"))"; n=$((n + 1)); else say "$s stopped"; fi
    done
    if [ "$n" -eq "${#SERVICES[@]}" ]; then
        sinfo -h -N -o 'cluster: node %N %T, cpus %c, gres %G, partition %P' 2>/dev/null || true
        echo "SLURM_CONF=$SLURM_CONF_FILE"
        if [ -n "$PREFIX" ]; then
            say "SLURM's clients are under $PREFIX: in the sweep's shell, . $DIR/slurm.env (PATH, LD_LIBRARY_PATH, SLURM_CONF)"
        fi
        if [ -n "$NO_TRACKING" ]; then
            say "no tracking server (--no-tracking): the runs go into an SQLite file, tracking.uri=sqlite:///$DIR/mlflow.db"
            echo "MLFLOW_TRACKING_URI=sqlite:///$DIR/mlflow.db"
            return 0
        fi
        say "MLflow login: user $MLFLOW_ADMIN, in $CREDENTIALS, sent to this server only: tracking=server reads it" \
            "from a launch in $(dirname "$DIR") (elsewhere: tracking.credentials=$CREDENTIALS)"
        echo "MLFLOW_TRACKING_URI=http://$(uri_host):$PORT"
        return 0
    fi
    [ "$n" -eq 0 ] && return 3
    return 1
}

now() { date +%s.%N; }
wait_gone() { while [ -n "$(squeue -h -j "$1" 2>/dev/null)" ]; do sleep 0.05; done; }

cmd_overhead() {  # trivial jobs (each prints its start time); polled with squeue every 0.05 s
    local n=${N_OVERHEAD:-16} out=$DIR/overhead t0 t1 id i lat=0 run=0
    running slurmctld || die "the cluster is not up (scripts/cluster.sh up)"
    rm -rf "$out" && mkdir -p "$out"
    for ((i = 0; i < n; i++)); do
        t0=$(now)
        id=$(sbatch --parsable -o "$out/%j.out" -c 1 --wrap 'date +%s.%N')
        wait_gone "$id"
        t1=$(now)
        lat=$(awk -v a="$t0" -v b="$t1" -v s="$lat" 'BEGIN { print s + b - a }')
        run=$(awk -v a="$t0" -v b="$(cat "$out/$id.out")" -v s="$run" 'BEGIN { print s + b - a }')
    done
    awk -v l="$lat" -v r="$run" -v n="$n" 'BEGIN { printf "cluster: %d trivial jobs one after another: %.2f s from sbatch to the job gone from squeue (%.2f s to its start)\n", n, l / n, r / n }'
    t0=$(now)
    id=$(sbatch --parsable -o "$out/%A_%a.out" -c 1 --array="0-$((n - 1))" --wrap 'date +%s.%N')
    wait_gone "$id"
    t1=$(now)
    awk -v a="$t0" -v b="$t1" -v n="$n" -v c="$(nproc)" 'BEGIN { printf "cluster: an array of %d trivial jobs on %d cpus: %.2f s from sbatch to the last one gone, %.2f s per job\n", n, c, b - a, (b - a) / n }'
}

# ---------------------------------------------------------------- main
need_root() { [ "$(id -u)" -eq 0 ] || die "$CMD needs root (SLURM's daemons, the database users, apt-get)"; }

case "$CMD" in
    install)
        need_root
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${DEBIAN_PACKAGES[@]}" > /dev/null
        say "installed ${DEBIAN_PACKAGES[*]}"
        ;;
    up)
        need_root
        t0=$SECONDS
        if [ -n "$PREFIX" ]; then
            [ -d "$PREFIX" ] || die "no directory $PREFIX: scripts/cluster.sh unpack DEBDIR $PREFIX"
            PREFIX=$(cd "$PREFIX" && pwd)
        fi
        any=0; for s in "${SERVICES[@]}"; do running "$s" && any=1; done
        if [ "$any" = 1 ]; then  # up again: the settings it was started with, unless asked otherwise
            for v in HOST PORT WORKERS PY FAKE_GPUS PREFIX NO_TRACKING PORT_OFFSET; do
                old=$(saved "$v"); new=${!v}
                if [ -n "$new" ] && [ "$new" != "$old" ]; then
                    die "the cluster in $DIR is up with $v=${old:-<none>}: scripts/cluster.sh down first to change it"
                fi
                printf -v "$v" '%s' "$old"
            done
        fi
        apply_settings
        if [ -n "$PREFIX" ]; then  # every program from P (PATH has P's first), none of the system's
            for b in munged mariadbd mariadb-install-db mariadb slurmdbd slurmctld slurmd slurmstepd \
                sbatch srun squeue sacct scancel sinfo scontrol; do
                [[ "$(command -v "$b")" == "$PREFIX"/* ]] || die "$b is missing under $PREFIX: scripts/cluster.sh unpack DEBDIR $PREFIX"
            done
            if ! id -u mysql > /dev/null 2>&1; then  # MariaDB's own user, as its package's postinst makes it
                useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin mysql \
                    || die "could not create the system user mysql (MariaDB runs as it)"
                say "created the system user mysql (MariaDB runs as it)"
            fi
        fi
        for b in munged mariadbd mariadb-install-db slurmdbd slurmctld slurmd sbatch runuser; do
            command -v "$b" > /dev/null || die "$b is missing: scripts/cluster.sh install"
        done
        users=(postgres mysql)
        if [ -n "$NO_TRACKING" ]; then
            users=(mysql)
        else
            [ -n "$(pg_bin)" ] || die "PostgreSQL is missing: scripts/cluster.sh install"
        fi
        for u in "${users[@]}"; do
            runuser -u "$u" -- test -x "$DIR" \
                || die "user $u cannot reach $DIR: choose a --dir whose parent directories others may enter"
        done
        HOST=${HOST:-127.0.0.1} PORT=${PORT:-5000} WORKERS=${WORKERS:-4} PY=${PY:-$(command -v python || command -v python3 || true)}
        PY=$(command -v "$PY" || echo "$PY")
        printf 'HOST=%s\nPORT=%s\nWORKERS=%s\nPY=%s\nFAKE_GPUS=%s\n' "$HOST" "$PORT" "$WORKERS" "$PY" "$FAKE_GPUS" > "$SETTINGS"
        if [ -n "$PREFIX$NO_TRACKING$PORT_OFFSET" ]; then
            printf 'PREFIX=%s\nNO_TRACKING=%s\nPORT_OFFSET=%s\n' "$PREFIX" "$NO_TRACKING" "$PORT_OFFSET" >> "$SETTINGS"
        fi
        if [ -n "$PREFIX" ] && { [ "$any" = 0 ] || [ ! -d "$DIR/lib" ]; }; then
            say "SLURM, munge and MariaDB from $PREFIX; $(link_prefix_libs) of its libraries are missing here (linked in $DIR/lib)"
        fi
        t=$SECONDS; start_munge; start_slurm; t_slurm=$((SECONDS - t))
        if [ -n "$NO_TRACKING" ]; then
            say "up in $((SECONDS - t0))s (munge+SLURM ${t_slurm}s; no PostgreSQL, no MLflow server); state in $DIR"
        else
            t=$SECONDS; start_postgres; provision_postgres; t_pg=$((SECONDS - t))
            t=$SECONDS; start_mlflow; t_mlflow=$((SECONDS - t))
            say "up in $((SECONDS - t0))s (munge+SLURM ${t_slurm}s, PostgreSQL ${t_pg}s, MLflow ${t_mlflow}s); state in $DIR"
        fi
        cmd_status | grep -v -E '^cluster: .* running'
        ;;
    status|down|overhead)
        HOST=$(saved HOST) PORT=$(saved PORT)
        HOST=${HOST:-127.0.0.1} PORT=${PORT:-5000}
        PREFIX=$(saved PREFIX) NO_TRACKING=$(saved NO_TRACKING) PORT_OFFSET=$(saved PORT_OFFSET)
        apply_settings
        case "$CMD" in
            status) cmd_status ;;
            down) need_root; cmd_down ;;
            overhead) cmd_overhead ;;
        esac
        ;;
    *) die "unknown command '$CMD' (install, up, status, down, overhead, fetch, unpack)" ;;
esac
