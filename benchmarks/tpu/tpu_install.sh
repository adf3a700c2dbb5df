#!/usr/bin/env bash
# On the TPU machine without network (see benchmarks/tpu/tpu_wheels.sh, run beforehand where there is
# network): installs the packages of .whl-tpu/requirements.txt into /tmp/site from the machine's
# own index (/opt/pypi/files, /opt/pypi-more/files, /opt/wheels for torch) and the carried wheels
# in .whl-tpu/, without dependencies and without touching the machine's JAX, numpy and scipy.
# jaxtune itself is not installed (pip cannot install it editable with --target): the repository's
# root goes on PYTHONPATH after /tmp/site.
#
#   source benchmarks/tpu/tpu_install.sh  # from the repository's root: installs, then exports PYTHONPATH
#   bash benchmarks/tpu/tpu_install.sh    # installs, then prints the export line to run
#
# A second run finds /tmp/site/.done (written with the requirements it installed) and skips the
# install. SITE=DIR installs elsewhere; PYTHON=... names another interpreter (default python3).
_tpu_install() {
    local root site python started reqs
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
    site=${SITE:-/tmp/site}
    python=${PYTHON:-python3}
    reqs="$root/.whl-tpu/requirements.txt"
    if [ ! -f "$reqs" ]; then
        echo "tpu_install.sh: $reqs is missing: run benchmarks/tpu/tpu_wheels.sh where there is network" >&2
        return 1
    fi
    if [ -f "$site/.done" ] && cmp -s "$reqs" "$site/.done"; then
        echo "tpu_install.sh: $site already holds .whl-tpu/requirements.txt's packages; nothing to do"
    else
        rm -rf "$site"
        started=$(date +%s)
        (cd "$root" && PIP_CONFIG_FILE=/dev/null "$python" -m pip install --isolated --quiet \
            --disable-pip-version-check --no-index --no-deps --no-compile --target "$site" \
            --find-links /opt/pypi/files --find-links /opt/pypi-more/files --find-links /opt/wheels \
            --find-links .whl-tpu -r .whl-tpu/requirements.txt) || return 1
        cp "$reqs" "$site/.done"
        echo "tpu_install.sh: installed $(grep -c . "$reqs") packages into $site in $(($(date +%s) - started)) s"
    fi
    TPU_INSTALL_EXPORT="export PYTHONPATH=\${PYTHONPATH:+\$PYTHONPATH:}$site:$root"
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then  # sourced: install, then extend this shell's PYTHONPATH
    if _tpu_install; then
        case ":${PYTHONPATH:-}:" in
            *":${SITE:-/tmp/site}:"*) ;;
            *) eval "$TPU_INSTALL_EXPORT" ;;
        esac
        echo "PYTHONPATH=$PYTHONPATH"
    fi
    unset -f _tpu_install
    unset TPU_INSTALL_EXPORT
else
    set -euo pipefail
    _tpu_install
    echo "then run (or source this script instead):"
    echo "  $TPU_INSTALL_EXPORT"
fi
