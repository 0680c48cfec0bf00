#!/bin/bash
# The image's HEALTHCHECK: healthy when the server's `/health` answers 200, which ember serve does
# only while its engine loop is making progress (503 while loading, draining or stalled).
#
# The Debian bases (debian:bookworm-slim for the CPU image, the debootstrap minbase CI builds on)
# have no curl or wget, and ember has no HTTP client command; every base, the official ROCm images
# (Ubuntu) included, has bash, whose /dev/tcp redirection is the HTTP client here.
#
# The address is read from PID 1's command line, which is ember serve itself (the entrypoint execs
# it), so a `--port` or `--host` given to `docker run` is followed.
set -euo pipefail

mapfile -d '' -t command_line </proc/1/cmdline
if [ "${#command_line[@]}" -lt 2 ] || [ "${command_line[1]}" != serve ]; then
    echo "PID 1 is not ember serve (${command_line[*]:0:2}): nothing to check" >&2
    exit 1
fi
host=127.0.0.1
port=""
for ((index = 2; index < ${#command_line[@]}; index++)); do
    argument="${command_line[index]}"
    next="${command_line[index + 1]:-}"
    case "$argument" in
        --host) host="$next" ;;
        --host=*) host="${argument#--host=}" ;;
        --port) port="$next" ;;
        --port=*) port="${argument#--port=}" ;;
    esac
done
# A wildcard listen address is reached through loopback.
case "$host" in
    0.0.0.0 | "::" | "[::]") host=127.0.0.1 ;;
esac
if [ -z "$port" ] || [ "$port" = 0 ]; then
    echo "ember serve was started without a fixed --port: cannot tell where /health is" >&2
    exit 1
fi

# Every failure exits 1, the status Docker reads as unhealthy (2 is reserved).
if ! exec 3<>"/dev/tcp/$host/$port"; then
    echo "cannot connect to $host:$port" >&2
    exit 1
fi
printf 'GET /health HTTP/1.1\r\nHost: %s:%s\r\nConnection: close\r\n\r\n' "$host" "$port" >&3
if ! IFS= read -r -t 5 status_line <&3; then
    echo "GET http://$host:$port/health: no answer within 5 s" >&2
    exit 1
fi
# The rest of the answer is read too, so the server is not left writing into a closed socket; on
# failure the body says why (loading, draining, or how long the engine has been stalled), and
# Docker keeps this output in the container's health log.
IFS= read -r -d '' -t 5 response <&3 || true
exec 3<&-
case "$status_line" in
    "HTTP/1."?" 200 "*)
        exit 0
        ;;
esac
echo "GET http://$host:$port/health: ${status_line%$'\r'}: ${response##*$'\r\n\r\n'}" >&2
exit 1
