#!/usr/bin/env bats
# `llmgw keys` in shell pipelines, as an operator would use it.

bats_require_minimum_version 1.5.0

setup() {
    ROOT="$(cd "$BATS_TEST_DIRNAME/../.." && pwd)"
    PATH="$ROOT/.venv/bin:$PATH"
    export LLMGW_STORE="sqlite://$BATS_TEST_TMPDIR/llmgw.db"
    export LLMGW_CONFIG="$BATS_TEST_TMPDIR/llmgw.toml"
    : >"$LLMGW_CONFIG"
}

@test "create prints the secret once, on stdout alone" {
    run --separate-stderr llmgw keys create --store --name ci
    [ "$status" -eq 0 ]
    [[ "$output" =~ ^sk-llmgw-[A-Za-z0-9_-]{43}$ ]]
    [[ "$stderr" == *"shown only now"* ]]
}

@test "create --json gives a key that list --json shows without its secret" {
    id=$(llmgw keys create --store --name ci --models a,b --json | jq -r .id)
    run llmgw keys list --store --json
    [ "$status" -eq 0 ]
    [ "$(echo "$output" | jq -r '.[0].id')" = "$id" ]
    [ "$(echo "$output" | jq -c '.[0].models')" = '["a","b"]' ]
    [ "$(echo "$output" | jq '.[0] | has("secret")')" = "false" ]
}

@test "keys revoked through a pipeline leave the list and stay in --all" {
    llmgw keys create --store --name one --json >/dev/null
    llmgw keys create --store --name two --json >/dev/null
    llmgw keys list --store --json | jq -r '.[] | select(.name == "one") | .id' | xargs llmgw keys revoke --store
    run llmgw keys list --store --json
    [ "$(echo "$output" | jq -r '[.[].name] | join(",")')" = "two" ]
    run llmgw keys list --store --all --json
    [ "$(echo "$output" | jq -r '.[] | select(.name == "one") | .state')" = "revoked" ]
}

@test "the bare group lists keys in aligned columns" {
    llmgw keys create --store --name ci --expires 30d --json >/dev/null
    run llmgw keys list --store
    [ "$status" -eq 0 ]
    [[ "${lines[0]}" =~ ^ID\ +NAME\ +PREFIX ]]
    [[ "${lines[1]}" == *" ci "* ]]
}

@test "revoking an unknown key fails with one line that says what to do" {
    run --separate-stderr llmgw keys revoke --store key_nope
    [ "$status" -eq 1 ]
    [ "$stderr" = "Error: no such key: key_nope (see \`llmgw keys list\`)" ]
}

@test "a bad --expires is refused with examples and creates nothing" {
    run --separate-stderr llmgw keys create --store --name ci --expires soon
    [ "$status" -eq 2 ]
    [[ "$stderr" == *"like 90m, 12h or 30d"* ]]
    [ "$(llmgw keys list --store --json | jq length)" = "0" ]
}

@test "an unknown key in the config file is named, with the file" {
    echo 'colour = "blue"' >"$LLMGW_CONFIG"
    run --separate-stderr llmgw keys list --store
    [ "$status" -eq 1 ]
    [ "$stderr" = "Error: $LLMGW_CONFIG: unknown key 'colour'" ]
}

@test "the example config loads as it is" {
    llmgw config example >"$LLMGW_CONFIG"
    run llmgw config check
    [ "$status" -eq 0 ]
    [ "$output" = "$LLMGW_CONFIG: ok" ]
}

@test "store migrate applies the migrations once" {
    run llmgw store migrate
    [ "$status" -eq 0 ]
    [[ "$output" == *"applied m001_initial"* ]]
    run llmgw store migrate --check
    [ "$status" -eq 0 ]
}
