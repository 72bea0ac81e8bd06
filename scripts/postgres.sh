#!/usr/bin/env bash
# A throwaway PostgreSQL cluster for tests, on 127.0.0.1 and a free port, with all its data in DIR.
#
#   scripts/postgres.sh start DIR   initdb (first time), start, create role+database "ckptflow";
#                                   writes DIR/postgres.pid and DIR/url, prints the URL
#   scripts/postgres.sh url DIR     prints the URL of the running cluster
#   scripts/postgres.sh stop DIR    stops the cluster by its pid (pg_ctl stop -m fast)
#
#   export CKPTFLOW_TEST_POSTGRES_URL=$(scripts/postgres.sh start .scratch/pg)
#
# Trust authentication, loopback only, fsync off: it holds test data and nothing else. If the
# PostgreSQL binaries are missing they are installed with apt-get, without Debian's service cluster.
set -euo pipefail

usage() {
    echo "usage: $0 start|stop|url DIR" >&2
    exit 2
}
[ $# -eq 2 ] || usage
command=$1
mkdir -p "$2"
dir=$(cd "$2" && pwd)
data=$dir/data
pidfile=$dir/postgres.pid
urlfile=$dir/url

pg_bin() {
    ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1
}

install_postgres() {
    echo "postgres.sh: PostgreSQL binaries not found; installing the Debian package" >&2
    # No "main" cluster: the tests' cluster lives in DIR, and nothing should run as a system service.
    mkdir -p /etc/postgresql-common
    [ -e /etc/postgresql-common/createcluster.conf ] ||
        echo "create_main_cluster = false" >/etc/postgresql-common/createcluster.conf
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y -o Dpkg::Options::=--force-confold postgresql
}

# The server refuses to run as root: run cluster commands as the postgres user when we are root.
as_owner() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

running_pid() {
    # Prints the pid if the cluster this script started is alive.
    [ -f "$pidfile" ] || return 1
    local pid
    pid=$(cat "$pidfile")
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
    # A zombie answers kill -0 too: a stopped postmaster whose parent has not reaped it yet.
    [ "$(ps -o stat= -p "$pid" 2>/dev/null | cut -c1)" != Z ] || return 1
    echo "$pid"
}

free_port() {
    local port
    for _ in $(seq 1 100); do
        port=$((20000 + RANDOM % 40000))
        # Nothing answers on it: free (a race with another process is possible but unlikely).
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return 0
        fi
    done
    echo "postgres.sh: no free port found" >&2
    return 1
}

start() {
    if running_pid >/dev/null; then
        cat "$urlfile"
        return 0
    fi
    local bin
    bin=$(pg_bin)
    if [ -z "$bin" ]; then
        install_postgres
        bin=$(pg_bin)
    fi
    [ -n "$bin" ] || { echo "postgres.sh: no PostgreSQL binaries under /usr/lib/postgresql" >&2; exit 1; }
    if [ "$(id -u)" = 0 ]; then
        chown -R postgres: "$dir"
        if ! runuser -u postgres -- test -w "$dir"; then
            echo "postgres.sh: user postgres cannot reach $dir (a parent directory is private); use a DIR under /tmp" >&2
            exit 1
        fi
    fi
    if [ ! -f "$data/PG_VERSION" ]; then
        as_owner "$bin/initdb" -D "$data" -U postgres -E UTF8 --auth=trust --no-sync >"$dir/initdb.log"
        # Loopback and the socket in DIR only; trust is acceptable for a test cluster nobody else reaches.
        printf '%s\n' "local all all trust" "host all all 127.0.0.1/32 trust" >"$data/pg_hba.conf"
        if [ "$(id -u)" = 0 ]; then chown postgres: "$data/pg_hba.conf"; fi
    fi
    local port
    port=$(free_port)
    as_owner "$bin/pg_ctl" -D "$data" -l "$dir/postgres.log" -w -t 60 start \
        -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200" >/dev/null
    head -n 1 "$data/postmaster.pid" >"$pidfile"
    local psql=("$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 -qAt)
    if [ -z "$("${psql[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname = 'ckptflow'")" ]; then
        "${psql[@]}" -c "CREATE ROLE ckptflow LOGIN"
    fi
    if [ -z "$("${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = 'ckptflow'")" ]; then
        "${psql[@]}" -c "CREATE DATABASE ckptflow OWNER ckptflow"
    fi
    echo "postgresql+psycopg://ckptflow@127.0.0.1:$port/ckptflow" >"$urlfile"
    cat "$urlfile"
}

stop() {
    local pid bin
    if ! pid=$(running_pid); then
        echo "postgres.sh: no cluster running from $dir" >&2
        rm -f "$pidfile" "$urlfile"
        return 0
    fi
    bin=$(pg_bin)
    # pg_ctl stops the postmaster whose pid is in DIR/data/postmaster.pid: the one we started.
    if ! as_owner "$bin/pg_ctl" -D "$data" -w -t 60 stop -m fast >/dev/null; then
        kill -TERM "$pid"
    fi
    rm -f "$pidfile" "$urlfile"
}

url() {
    running_pid >/dev/null || { echo "postgres.sh: no cluster running from $dir; run: $0 start $dir" >&2; exit 1; }
    cat "$urlfile"
}

case $command in
start) start ;;
stop) stop ;;
url) url ;;
*) usage ;;
esac
