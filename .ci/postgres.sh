#!/usr/bin/env bash
# A throwaway PostgreSQL server for tests/api/test_api_postgres.py.
#
#   source .ci/postgres.sh        # install if missing, start, export PIPESCHED_TEST_POSTGRES_URL
#   bash .ci/postgres.sh stop     # stop it
#
# Settings: PIPESCHED_PG_DIR (data dir, default /tmp/pipesched-postgres), PIPESCHED_PG_PORT (default 54329),
# PIPESCHED_PG_STOP_MODE (pg_ctl's stop mode: fast by default; immediate crashes it, as an outage test wants).
# Runs the server as the `postgres` user when started as root (initdb refuses root). Listens on 127.0.0.1 only,
# trust authentication: for tests, never for data you keep.

_pg_main() {
    local dir="${PIPESCHED_PG_DIR:-/tmp/pipesched-postgres}"
    local port="${PIPESCHED_PG_PORT:-54329}"
    local bin
    bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
    if [ -z "$bin" ] && ! command -v initdb >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "postgres.sh: installing postgresql with apt-get" >&2
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null || return 1
            bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
        else
            echo "postgres.sh: no PostgreSQL binaries and cannot apt-get install postgresql" >&2
            return 1
        fi
    fi
    local initdb="${bin:+$bin/}initdb" pg_ctl="${bin:+$bin/}pg_ctl" psql="${bin:+$bin/}psql"
    [ -n "$bin" ] || { initdb=initdb; pg_ctl=pg_ctl; psql=psql; }
    local run=()
    if [ "$(id -u)" = 0 ]; then
        run=(runuser -u postgres --)
    fi

    if [ "${1:-start}" = stop ]; then
        [ -d "$dir/data" ] && "${run[@]}" "$pg_ctl" -D "$dir/data" -m "${PIPESCHED_PG_STOP_MODE:-fast}" -w stop \
            >/dev/null 2>&1
        return 0
    fi

    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres "$dir"
    if [ ! -f "$dir/data/PG_VERSION" ]; then
        "${run[@]}" "$initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >"$dir/initdb.log" 2>&1 || {
            cat "$dir/initdb.log" >&2
            return 1
        }
    fi
    if ! "${run[@]}" "$pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
        "${run[@]}" "$pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
            -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off" start >/dev/null || {
            cat "$dir/server.log" >&2
            return 1
        }
    fi
    "${run[@]}" "$psql" -h 127.0.0.1 -p "$port" -U postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = 'pipesched_test'" | grep -q 1 ||
        "${run[@]}" "$psql" -h 127.0.0.1 -p "$port" -U postgres -qc "CREATE DATABASE pipesched_test" || return 1
    export PIPESCHED_TEST_POSTGRES_URL="postgresql+psycopg://postgres@127.0.0.1:$port/pipesched_test"
    echo "postgres.sh: PIPESCHED_TEST_POSTGRES_URL=$PIPESCHED_TEST_POSTGRES_URL" >&2
}

_pg_main "$@"
