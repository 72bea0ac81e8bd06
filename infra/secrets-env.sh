#!/bin/sh
# Export secrets kept in files (compose secrets, Kubernetes secret volumes) as the environment variables
# the programs read, then exec the command. Values are never printed, not even in errors.
#
#   SECRETS_FROM_FILES="PREFECT_API_AUTH_STRING=/run/secrets/prefect_auth_string PGPASSWORD=/run/secrets/ckptflow_db_password" \
#       secrets-env prefect worker start --pool ckptflow
#
# Why files: a value given to compose as `environment:` shows in `docker inspect` and in the compose
# file's rendered config; a secret file is mounted into just the containers that list it. Prefect and
# libpq read these settings only from the environment, hence this step. One trailing newline is
# dropped (as $(cat) does), so `echo secret > file` works.
set -eu
for pair in ${SECRETS_FROM_FILES:-}; do
    name=${pair%%=*}
    file=${pair#*=}
    case $name in
        '' | [0-9]* | *[!A-Za-z0-9_]*)
            echo "secrets-env: '$name' in SECRETS_FROM_FILES is not a variable name (write NAME=/path)" >&2
            exit 2
            ;;
    esac
    if [ "$file" = "$pair" ] || [ ! -r "$file" ]; then
        echo "secrets-env: cannot read the secret file for $name ('$file'); is the secret mounted?" >&2
        exit 2
    fi
    value=$(cat "$file")
    if [ -z "$value" ]; then
        echo "secrets-env: the secret file for $name ('$file') is empty" >&2
        exit 2
    fi
    export "$name=$value"
done
unset SECRETS_FROM_FILES pair name file value
exec "$@"
