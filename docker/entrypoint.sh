#!/bin/sh
# The image's entrypoint: `docker run IMAGE -m /models/x.gguf` serves, `docker run IMAGE info` (or
# any other ember command) runs that command.
#
# Why a script and not `ENTRYPOINT ["ember"]` with `CMD ["serve", ...]`: arguments given to
# `docker run` replace CMD entirely, so the documented `docker run ... IMAGE -m /models/x.gguf`
# would run `ember -m ...` without `serve` and without the container's listen address. Here:
#
# - no arguments, or a first argument that is an option (`-m ...`), or `serve`: `ember serve` with
#   `--host 0.0.0.0 --port 8080` (the EXPOSEd port) unless the arguments set them;
# - `--version`, `-V`, `--help`, `-h` alone: ember's own, as `ember --version` answers them;
# - anything else (`info`, `run ...`, `devices`, `bench ...`): `ember` with the arguments as given.
#
# `exec` makes ember PID 1, so `docker stop` (SIGTERM) reaches the server itself and drains it, and
# the container's exit status is ember's.
set -eu

ember=/opt/ember/ember

case "${1:-}" in
    --version | -V | --help | -h)
        exec "$ember" "$@"
        ;;
    serve)
        shift
        ;;
    "" | -*)
        ;;
    *)
        exec "$ember" "$@"
        ;;
esac

has_host=""
has_port=""
for argument in "$@"; do
    case "$argument" in
        --host | --host=*) has_host=1 ;;
        --port | --port=*) has_port=1 ;;
    esac
done
if [ -z "$has_port" ]; then
    set -- --port 8080 "$@"
fi
if [ -z "$has_host" ]; then
    set -- --host 0.0.0.0 "$@"
fi
exec "$ember" serve "$@"
