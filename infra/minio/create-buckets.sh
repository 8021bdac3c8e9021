#!/bin/sh
# One-shot initialisation of the object store (service `minio-init` in infra/compose.yaml): the buckets
# and the access key the MLflow server and the workers use, which may read and write objects but not
# administer MinIO. Safe to run again: every step leaves existing buckets, users and policies alone.
set -eu

mc alias set local http://minio:9000 "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD"
# MLflow's artifacts (models, reports, plots) and the pipeline's data and stage outputs (DVC remote,
# s3:// hand-overs between work pools).
mc mb --ignore-existing local/mlflow-artifacts local/rlhf-data

if ! mc admin user info local "$S3_ACCESS_KEY" >/dev/null 2>&1; then
    mc admin user add local "$S3_ACCESS_KEY" "$S3_SECRET_KEY"
fi
# Shell pattern matching, not grep: the mc image is minimal.
case "$(mc admin user info local "$S3_ACCESS_KEY")" in
    *readwrite*) ;;
    *) mc admin policy attach local readwrite --user "$S3_ACCESS_KEY" ;;
esac
echo "buckets mlflow-artifacts and rlhf-data ready; access key $S3_ACCESS_KEY may read and write them"
