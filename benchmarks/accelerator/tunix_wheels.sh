#!/usr/bin/env bash
# Tunix's side of the accelerator benchmark (benchmarks/accelerator/tunix_side.py) in a site folder of its own:
# the pins of benchmarks/accelerator/tunix_requirements.txt, installed without dependencies, so google-tunix's
# declared ones (safetensors<0.8 against jaxtune's >=0.8, TensorFlow Datasets, grain, kagglehub, orbax...)
# stay out. Everything else its step imports (jax, optax, numpy, ml_dtypes, opt_einsum, safetensors, absl-py,
# PyYAML, rich, typing_extensions, fsspec, huggingface_hub) is jaxtune's own environment's: on the TPU
# machine, /tmp/site (benchmarks/tpu/tpu_install.sh).
#
#   benchmarks/accelerator/tunix_wheels.sh                 # here, with network: the wheels the TPU machine's index
#                                                          # lacks (google-tunix, qwix) into .whl-tunix/ (git-ignored)
#   benchmarks/accelerator/tunix_wheels.sh install [DIR]   # there (or here): installs into DIR (default .tunix-site,
#                                                          # which the benchmark reads; TUNIX_SITE=DIR names another)
#
# Where .whl-tunix/ holds wheels, the install reads nothing but them and the local index's folders
# (/opt/pypi/files, /opt/pypi-more/files: no network, as tpu_install.sh); otherwise pip's own index.
# It prints the folder's size: 8.8 MiB, without bytecode (--no-compile).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
REQUIREMENTS=benchmarks/accelerator/tunix_requirements.txt
OUT=.whl-tunix
INDEX_DIRS=(/opt/pypi/files /opt/pypi-more/files)

if [ "${1:-}" = "install" ]; then
    site=${2:-${TUNIX_SITE:-.tunix-site}}
    offline=()
    if compgen -G "$OUT/*.whl" >/dev/null; then
        offline=(env PIP_CONFIG_FILE=/dev/null)
        links=(--isolated --no-index --find-links "$OUT")
        for dir in "${INDEX_DIRS[@]}"; do if [ -d "$dir" ]; then links+=(--find-links "$dir"); fi; done
    else
        links=()
    fi
    rm -rf "$site"
    "${offline[@]}" "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target "$site" \
        "${links[@]}" -r "$REQUIREMENTS"
    echo "installed $(grep -c '==' "$REQUIREMENTS") packages into $site: $(du -sh "$site" | cut -f1)"
    echo "then: export TUNIX_SITE=$(cd "$site" && pwd)"
    exit 0
fi

# Carry each pin whose wheel (Python 3.11, x86-64 Linux) the local index does not hold.
rm -rf "$OUT"
mkdir -p "$OUT"
carry=()
while read -r pin; do
    name=${pin%%==*} version=${pin#*==}
    stem="$(echo "$name" | tr 'A-Z-' 'a-z_')-$version-"
    found=$(for dir in "${INDEX_DIRS[@]}"; do ls "$dir" 2>/dev/null; done | grep -i "^$stem" | grep -E 'py3-none-any|cp311' || true)
    [ -z "$found" ] && carry+=("$pin")
done < <(grep -E '^[A-Za-z0-9_.-]+==' "$REQUIREMENTS")
if [ ${#carry[@]} -gt 0 ]; then
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.11 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$OUT" "${carry[@]}"
fi
echo "carried in $OUT/ (${#carry[@]} of $(grep -c '==' "$REQUIREMENTS") pins; the index holds the rest):"
ls -1 "$OUT" | sed 's|^|  |'
du -ch "$OUT" | tail -1
