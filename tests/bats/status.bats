#!/usr/bin/env bats
# `llmgw status`, `models`, `explain-placement` and `retry` in shell pipelines, against a
# real llmgw-scheduler with one model and no agent, so the model fits nowhere.

bats_require_minimum_version 1.5.0

# Run "$@" until it succeeds, for at most 15 s: a loaded machine loses every fixed sleep.
eventually() {
    local end=$((SECONDS + 15))
    until "$@"; do
        ((SECONDS < end)) || return 1
        sleep 0.1
    done
}

unplaceable() {
    [ "$(llmgw models --json | jq -r '.[] | select(.state=="unplaceable") | .name')" = lonely ]
}

setup_file() {
    ROOT="$(cd "$BATS_TEST_DIRNAME/../.." && pwd)"
    export PATH="$ROOT/.venv/bin:$PATH"
    export LLMGW_STORE="sqlite://$BATS_FILE_TMPDIR/llmgw.db"
    export LLMGW_CONFIG="$BATS_FILE_TMPDIR/llmgw.toml"
    unset LLMGW_ADMIN_URL LLMGW_ADMIN_TOKEN
    read -r bus pub metrics admin closed < <(python -c '
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
    export ADMIN_URL="http://127.0.0.1:$admin" CLOSED_URL="http://127.0.0.1:$closed"
    : >"$BATS_FILE_TMPDIR/lonely.gguf"
    cat >"$LLMGW_CONFIG" <<EOF
[paths]
config_dir = "$BATS_FILE_TMPDIR/etc"
state_dir = "$BATS_FILE_TMPDIR/state"
[scheduler]
bus = "tcp://127.0.0.1:$bus"
publish = "tcp://127.0.0.1:$pub"
metrics_listen = "127.0.0.1:$metrics"
admin_listen = "127.0.0.1:$admin"
tick_s = 0.2
settle_s = 0.5
[[models]]
name = "lonely"
source = "$BATS_FILE_TMPDIR/lonely.gguf"
[models.profile]
memory_bytes = 1073741824
EOF
    # fd 3 closed, or bats waits for the scheduler to exit before running any test.
    llmgw-scheduler >"$BATS_FILE_TMPDIR/scheduler.log" 2>&1 3>&- &
    echo $! >"$BATS_FILE_TMPDIR/scheduler.pid"
    if ! eventually llmgw models --json >/dev/null 2>&1; then
        cat "$BATS_FILE_TMPDIR/scheduler.log" >&3
        return 1
    fi
}

teardown_file() {
    local pid
    pid=$(cat "$BATS_FILE_TMPDIR/scheduler.pid")
    kill "$pid" 2>/dev/null || true
    eventually eval "! kill -0 $pid 2>/dev/null" || kill -9 "$pid" 2>/dev/null || true
}

@test "a model that fits nowhere shows as unplaceable in models --json" {
    eventually unplaceable
}

@test "status --json is one object with nodes, models and replicas" {
    run llmgw status --json
    [ "$status" -eq 0 ]
    [ "$(echo "$output" | jq -r 'keys | join(",")')" = "control_plane,models,nodes,replicas,restarts" ]
    [ "$(echo "$output" | jq -r '.models[0] | "\(.name) \(.ready)/\(.min)"')" = "lonely 0/1" ]
    [ "$(echo "$output" | jq '.replicas')" = "[]" ]
}

@test "status for people puts the unplaceable model first with why, and what to do on stderr" {
    eventually unplaceable
    run --separate-stderr llmgw status
    [ "$status" -eq 0 ]
    [[ "$output" == *$'\nMODELS\nNAME '*$'\nlonely '*"unplaceable  no nodes"* ]]
    [ "$stderr" = "lonely fits no node: see \`llmgw explain-placement lonely\`" ]
}

@test "explain-placement --json has no choice when no node has reported" {
    run llmgw explain-placement lonely --json
    [ "$status" -eq 0 ]
    [ "$(echo "$output" | jq -r '.choice')" = "null" ]
    [ "$(echo "$output" | jq -r '.need.memory')" = "1073741824" ]
    [ "$(echo "$output" | jq '.nodes')" = "[]" ]
}

@test "explain-placement of an unknown model exits 1 with one line" {
    run --separate-stderr llmgw explain-placement nope
    [ "$status" -eq 1 ]
    [ "$output" = "" ]
    [ "$stderr" = "Error: no model 'nope'" ]
}

@test "retry is queued: exit 0, and the word on stderr alone" {
    run --separate-stderr llmgw retry lonely
    [ "$status" -eq 0 ]
    [ "$output" = "" ]
    [ "$stderr" = "queued: retry lonely" ]
}

@test "replicas --model filters, and an empty answer is an empty array" {
    run llmgw replicas --model lonely --json
    [ "$status" -eq 0 ]
    [ "$output" = "[]" ]
}

@test "a bad token exits 1 with one line naming where the token came from" {
    LLMGW_ADMIN_TOKEN=wrong run --separate-stderr llmgw models --json
    [ "$status" -eq 1 ]
    [ "$output" = "" ]
    [ "${#stderr_lines[@]}" -eq 1 ]
    [[ "$stderr" == "Error: the scheduler at $ADMIN_URL refused the admin token from LLMGW_ADMIN_TOKEN "* ]]
}

@test "an unreachable scheduler exits 1 with one line naming its URL" {
    LLMGW_ADMIN_URL=$CLOSED_URL run --separate-stderr llmgw status
    [ "$status" -eq 1 ]
    [ "$output" = "" ]
    [ "$stderr" = "Error: cannot reach the scheduler at $CLOSED_URL: Connection refused (is llmgw-scheduler running? set --admin-url or LLMGW_ADMIN_URL)" ]
}

@test "a node registered with nodes add is listed live as never seen" {
    llmgw nodes add gpu-01 --json >/dev/null
    # shellcheck disable=SC2016
    eventually bash -c '[ "$(llmgw nodes --json | jq -r ".[] | select(.state==\"never seen\") | .name")" = gpu-01 ]'
    run llmgw nodes
    [ "$status" -eq 0 ]
    [[ "${lines[0]}" =~ ^NAME\ +STATE\ +MEMORY ]]
    [[ "${lines[1]}" =~ ^gpu-01\ +never\ seen\ +- ]]
}

@test "keys made through the admin API are listed, revoked, and in the audit log" {
    id=$(llmgw keys create --name via-api --json | jq -r .id)
    [ "$(llmgw keys list --json | jq -r '.[] | select(.name=="via-api") | .id')" = "$id" ]
    llmgw keys list --json | jq -r '.[] | select(.name=="via-api") | .id' | xargs llmgw keys revoke
    [ "$(llmgw keys list --all --json | jq -r ".[] | select(.id==\"$id\") | .state")" = revoked ]
    run llmgw audit --action keys --json
    [ "$status" -eq 0 ]
    [ "$(echo "$output" | jq -r "[.[] | select(.target==\"$id\") | .action] | join(\",\")")" = "keys.create,keys.revoke" ]
    [ "$(echo "$output" | jq -r '.[0].actor')" = "$(id -un)@$(hostname)" ]
    [ "$(echo "$output" | jq -r '.[0].client')" = "127.0.0.1" ]
}

@test "audit shows changes in aligned columns, and a bad --since is refused" {
    llmgw retry lonely 2>/dev/null
    run llmgw audit --since 1h
    [ "$status" -eq 0 ]
    [[ "${lines[0]}" =~ ^WHEN\ +ACTOR\ +CLIENT\ +ACTION\ +TARGET ]]
    [[ "$output" == *"models.retry"*"lonely"* ]]
    run --separate-stderr llmgw audit --since yesterday
    [ "$status" -eq 2 ]
    [[ "$stderr" == *"like 90m, 12h or 30d"* ]]
}

@test "revoking an unknown key through the API exits 1 and revokes nothing" {
    id=$(llmgw keys create --name keep --json | jq -r .id)
    run --separate-stderr llmgw keys revoke "$id" key_nope
    [ "$status" -eq 1 ]
    [ "$stderr" = "Error: no such key: key_nope (see \`llmgw keys list\`)" ]
    [ "$(llmgw keys list --json | jq -r ".[] | select(.id==\"$id\") | .state")" = active ]
}

@test "a queued change with --json prints the API's answer on stdout and nothing on stderr" {
    run --separate-stderr llmgw retry lonely --json
    [ "$status" -eq 0 ]
    [ "$stderr" = "" ]
    [ "$(echo "$output" | jq -r '.model + " " + .queued')" = "lonely retry" ]
    run --separate-stderr llmgw scale lonely --min 1 --max 2 --json
    [ "$status" -eq 0 ]
    [ "$(echo "$output" | jq -c '[.min, .max]')" = "[1,2]" ]
    [ "$(llmgw models --json | jq -r '.[] | select(.name=="lonely") | .max')" = 2 ]
}

@test "an operator's own token names them in the audit log, and a read token cannot change" {
    token=$(llmgw operators add ada --role admin)
    reader=$(llmgw operators add grafana --role read --json | jq -r .token)
    [ "$(llmgw operators list --json | jq -r '[.[] | "\(.name):\(.role)"] | join(",")')" = "ada:admin,grafana:read" ]
    # The token is never listed.
    ! llmgw operators list --json | grep -q "$token"
    LLMGW_ADMIN_TOKEN="$token" llmgw retry lonely >/dev/null
    [ "$(llmgw audit --action models.retry --json | jq -r '.[-1].actor')" = ada ]
    [ "$(llmgw audit --action models.retry --json | jq -r '.[-1].detail.claimed')" = "$(id -un)@$(hostname)" ]
    # A read token looks, and is refused a change in one line.
    LLMGW_ADMIN_TOKEN="$reader" llmgw models --json | jq -e '.[] | select(.name=="lonely")' >/dev/null
    run --separate-stderr env LLMGW_ADMIN_TOKEN="$reader" llmgw retry lonely
    [ "$status" -ne 0 ]
    [[ "$stderr" == *"operator 'grafana' has the read role"* ]]
    [ "$(echo "$stderr" | wc -l)" -eq 1 ]
    # ... and the attempt is on record: who, what, why not.
    [ "$(llmgw audit --action models.retry_refused --json | jq -r '.[-1] | "\(.actor) \(.target) \(.detail.role)"')" = "grafana lonely read" ]
    # Removed: the token stops working at once.
    llmgw operators remove grafana >/dev/null
    run --separate-stderr env LLMGW_ADMIN_TOKEN="$reader" llmgw models
    [ "$status" -ne 0 ]
    [[ "$stderr" == *"refused the admin token from LLMGW_ADMIN_TOKEN"* ]]
    run --separate-stderr llmgw operators add ada --role admin
    [ "$status" -ne 0 ]
    [[ "$stderr" == *"exists already"* ]]
}

@test "a rotated bootstrap token replaces the old one at once" {
    old=$(cat "$BATS_FILE_TMPDIR/etc/secrets/admin.token")
    new=$(LLMGW_ADMIN_TOKEN="$old" llmgw admin-token rotate)
    [ -n "$new" ] && [ "$new" != "$old" ]
    [ "$(cat "$BATS_FILE_TMPDIR/etc/secrets/admin.token")" = "$new" ]
    [ "$(stat -c %a "$BATS_FILE_TMPDIR/etc/secrets/admin.token")" = 600 ]
    run --separate-stderr env LLMGW_ADMIN_TOKEN="$old" llmgw models
    [ "$status" -ne 0 ]
    [[ "$stderr" == *"refused the admin token from LLMGW_ADMIN_TOKEN"* ]]
    llmgw models --json >/dev/null   # the file's token, as the CLI reads it
    [ "$(llmgw audit --action admin_token --json | jq -r '.[-1].action')" = admin_token.rotate ]
}

@test "nodes add says where the keys go on the node, not this machine's directory" {
    run --separate-stderr llmgw nodes add gpu-02
    [ "$status" -eq 0 ]
    [[ "$stderr" == *"its keypair is $BATS_FILE_TMPDIR/etc/pki/curve/gpu-02.key_secret (on the scheduler's host)"* ]]
    [[ "$stderr" == *"into the agent's <config_dir>/pki/curve/ (/etc/llmgw/pki/curve/ by default)"* ]]
}
