#!/usr/bin/env bash
# Run batchspec from cron: each run resumes OUT where the last one stopped, two runs never
# overlap (flock: a run that finds the previous one still going exits at once), and the log
# is rotated when it passes BATCHSPEC_LOG_BYTES (default 10 MB; 5 old logs are kept).
#
#   */30 * * * * /srv/batchspec/jobs/cron.sh /data/prompts.jsonl /data/out.jsonl --config /srv/job.toml
#
# Log: OUT's name with .cron.log (or BATCHSPEC_LOG). BATCHSPEC names the program (default: the
# repository's .venv/bin/batchspec, else batchspec on PATH).
set -u
if [ $# -lt 2 ]; then
    echo "usage: cron.sh INPUT OUT [batchspec run options]" >&2
    exit 2
fi
input=$1 out=$2
shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
program=${BATCHSPEC:-$here/.venv/bin/batchspec}
[ -x "$program" ] || program=batchspec
base=${out%.jsonl}
log=${BATCHSPEC_LOG:-$base.cron.log}
max_bytes=${BATCHSPEC_LOG_BYTES:-10000000}

exec 9>>"$base.cron.lock"
if ! flock -n 9; then
    exit 0  # the previous run is still going; cron stays quiet
fi

if [ -f "$log" ] && [ "$(stat -c %s "$log")" -ge "$max_bytes" ]; then
    for i in 4 3 2 1; do
        [ -f "$log.$i" ] && mv -f "$log.$i" "$log.$((i + 1))"
    done
    mv -f "$log" "$log.1"
fi

{
    echo "$(date -Is) start: $input -> $out"
    "$program" run "$input" --out "$out" --no-progress "$@"
    code=$?
    echo "$(date -Is) exit code $code"
} >>"$log" 2>&1
exit "$code"
