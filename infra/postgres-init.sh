#!/bin/sh
# First start of the postgres container (docker-entrypoint-initdb.d): one role and one database each for
# Prefect and the ckptflow catalog. The passwords come from the mounted secret files and reach psql
# through its environment (\getenv), never its command line or this script's output.
set -e
secrets=${CKPTFLOW_SECRETS_MOUNT:-/run/secrets}
PREFECT_DB_PASSWORD=$(cat "$secrets/prefect_db_password")
CKPTFLOW_DB_PASSWORD=$(cat "$secrets/ckptflow_db_password")
export PREFECT_DB_PASSWORD CKPTFLOW_DB_PASSWORD
psql -v ON_ERROR_STOP=1 --no-psqlrc --username "${POSTGRES_USER:-postgres}" --dbname postgres <<'SQL'
\getenv prefect_password PREFECT_DB_PASSWORD
\getenv ckptflow_password CKPTFLOW_DB_PASSWORD
SET password_encryption = 'scram-sha-256';
CREATE ROLE prefect LOGIN PASSWORD :'prefect_password';
CREATE ROLE ckptflow LOGIN PASSWORD :'ckptflow_password';
CREATE DATABASE prefect OWNER prefect;
CREATE DATABASE ckptflow OWNER ckptflow;
REVOKE ALL ON DATABASE prefect FROM PUBLIC;
REVOKE ALL ON DATABASE ckptflow FROM PUBLIC;
SQL
unset PREFECT_DB_PASSWORD CKPTFLOW_DB_PASSWORD
