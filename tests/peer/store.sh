# The store a peer suite mounts, by COALESCEFS_STORE: a backing directory (local, the default),
# a database file (sqlite), or a prefix on a SeaweedFS server started for the run (s3). Sourced
# by run-pjdfstest and run-fsx. `peer_store WORK REPO` sets `source` (the mount source) and
# `store_options` (mount options the store needs); `peer_store_stop WORK REPO` undoes it.
source="" store_options=""
peer_store() {
  local work=$1 repo=$2
  store_options=""
  case "${COALESCEFS_STORE:-local}" in
    local) source="$work/backing" ;;
    sqlite) source="sqlite:$work/tree.db" ;;
    s3)
      "$repo/scripts/s3-server" start "$work/s3" >/dev/null
      python3 "$repo/tests/lib/s3.py" make-bucket "$work/s3" peer
      # The server's endpoint and its test keys (the mount takes keys from the environment only).
      set -a
      # shellcheck disable=SC1091
      . "$work/s3/env"
      set +a
      source="s3://peer/$(basename "$work")"
      store_options="endpoint=$S3_ENDPOINT,region=$S3_REGION"
      ;;
    *)
      echo "COALESCEFS_STORE=$COALESCEFS_STORE: local, sqlite or s3" >&2
      exit 2
      ;;
  esac
}

peer_store_stop() {
  local work=$1 repo=$2
  if [ "${COALESCEFS_STORE:-local}" = s3 ] && [ -f "$work/s3/env" ]; then
    "$repo/scripts/s3-server" stop "$work/s3" >/dev/null 2>&1 || true
    # `forget` does not take an S3 source yet: its runtime directory (the daemon's log) by hand.
    # (named as src/runtime.rs escapes it: a '-' in the name is \x2d).
    local name
    name=$(basename "$work")
    rm -rf "/run/coalescefs/s3:--peer-${name//-/\\x2d}"
  fi
}
