#!/bin/sh
# Refuses to let the stack start with the placeholder credentials of infra/.env.example (service
# `check-credentials` in infra/compose.yaml; the databases and MinIO wait for it to succeed). Compose only
# checks that a variable is set, and a copied example is set: every service would come up with the
# published placeholder passwords. Each credential arrives as CHECK_<name of the infra/.env variable>.
set -eu

placeholders=""
for variable in $(env | sed -n 's/^\(CHECK_[A-Z0-9_]*\)=.*/\1/p'); do
    eval "value=\${$variable}"
    case "$value" in
        *change-me*) placeholders="$placeholders ${variable#CHECK_}" ;;
    esac
done
if [ -n "$placeholders" ]; then
    echo "infra/.env still holds the placeholder value of:$placeholders." >&2
    echo "Replace each with a fresh secret (openssl rand -hex 24; letters and digits only) and start again." >&2
    exit 1
fi
echo "credentials: no placeholder value left in infra/.env"
