#!/usr/bin/env bash
# One job at a time from a queue file, at the lowest CPU priority: the claims rows' training and
# evaluations on a shared CPU, where only one such process may run at once.
#
#     nohup nice -n 19 experiments/queue.sh [QUEUE_FILE] >> /tmp/runs/queue.log 2>&1 &
#
# QUEUE_FILE (default experiments/queue.txt) holds one command per line, run from the repository root
# in order; blank lines and lines starting with # are skipped; a line is known by its text, so a command
# queued twice needs a distinct trailing comment (`... report  # report 2`). `wait PID` waits for a process that is
# already running (e.g. a row started by hand) to end. A command that ended (with any status) is
# recorded in DONE_FILE (default /tmp/runs/queue.done) with its status, and not run again (a command that
# fails is tried again after RETRY_WAIT seconds, 600 by default, up to RETRIES more times, 3 by default:
# a checkout others edit can be broken for a while, and every command here resumes); the queue
# file is read again before each job, so lines may be appended while it runs. Every command here
# resumes where it stopped (`linjax train --resume`, `claims.py run` and `evaluate` skip what is
# done), so after a stop the same line can be run again: delete it from DONE_FILE, or start the
# queue again with an empty DONE_FILE. When no line is left it exits.
set -u
cd "$(dirname "$0")/.."
queue=${1:-experiments/queue.txt}
done_file=${DONE_FILE:-/tmp/runs/queue.done}
mkdir -p "$(dirname "$done_file")"
touch "$done_file"
while true; do
    next=""
    while IFS= read -r line; do
        case "$line" in ""|\#*) continue ;; esac
        if ! grep -qxF "ok $line" "$done_file" && ! grep -qxF "failed $line" "$done_file"; then
            next=$line
            break
        fi
    done < "$queue"
    if [ -z "$next" ]; then
        echo "$(date '+%F %T') queue empty"
        exit 0
    fi
    echo "$(date '+%F %T') start: $next"
    case "$next" in
        wait\ *) pid=${next#wait }; while kill -0 "$pid" 2>/dev/null; do sleep 60; done; status=0 ;;
        *) for try in $(seq 0 "${RETRIES:-3}"); do
               if [ "$try" -gt 0 ]; then
                   echo "$(date '+%F %T') exited with $status; again in ${RETRY_WAIT:-600} s (retry $try)"
                   sleep "${RETRY_WAIT:-600}"
               fi
               bash -c "$next"; status=$?
               [ "$status" -eq 0 ] && break
           done ;;
    esac
    echo "$(date '+%F %T') end ($status): $next"
    if [ "$status" -eq 0 ]; then echo "ok $next" >> "$done_file"; else echo "failed $next" >> "$done_file"; fi
done
