#!/usr/bin/env bash
# tools/bench/ab.py (two builds alternating run by run) inside a memory cgroup of CAP_GIB GiB
# (cgroup v1 or v2, root), so that `--slots auto` sizes its slot cache from the cap and the page
# cache of the layer files counts against it, as on a machine with that much memory.
#
#   tools/bench/ab_capped.sh CAP_GIB --a OLD_BIN --b NEW_BIN --model X.gturbo --slots auto ... [-- bench args]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cap_gib=$1
shift
bytes=$((cap_gib * 1024 * 1024 * 1024))
name="mference-ab-$$"
if [ -d /sys/fs/cgroup/memory ]; then
    cg=/sys/fs/cgroup/memory/$name
    mkdir "$cg"
    echo "$bytes" >"$cg/memory.limit_in_bytes"
    procs="$cg/cgroup.procs"
elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    echo +memory >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
    cg=/sys/fs/cgroup/$name
    mkdir "$cg"
    echo "$bytes" >"$cg/memory.max"
    echo 0 >"$cg/memory.swap.max" 2>/dev/null || true
    procs="$cg/cgroup.procs"
else
    echo "ab_capped: no cgroup memory controller (v1 /sys/fs/cgroup/memory or v2)" >&2
    exit 1
fi
trap 'rmdir "$cg" 2>/dev/null || true' EXIT
sync
echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
# The child shell joins the cgroup, then runs the A/B; the parent removes the cgroup afterwards.
bash -c 'echo $$ >"$1"; shift; exec python3 "$@"' _ "$procs" "$here/ab.py" "$@"
