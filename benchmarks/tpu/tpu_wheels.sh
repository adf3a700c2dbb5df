#!/usr/bin/env bash
# The wheels jaxtune needs on a TPU machine without network: Python 3.11.7 on x86-64, glibc 2.36,
# JAX 0.10.2 with jaxlib, libtpu, numpy and scipy installed (and pytest, hypothesis, sympy), and a
# local package index, /opt/pypi/files, /opt/pypi-more/files and /opt/wheels (torch 2.13.0+cpu),
# holding the same files as this machine's folders of those names.
#
# The closure: the packages .venv has installed that jaxtune's [project] dependencies need at run
# time (not the test or other extras), walked through each package's own requirements, less what
# that machine has already (EXCLUDE) and what only those need. Each package is taken at .venv's
# version (the one `make test` runs with) where the local index has that version as a wheel the
# machine takes (cp311, abi3 or py3; manylinux with glibc <= 2.36). Where it does not:
#   - jaxtune's direct dependencies (EXACT=direct) are carried at .venv's version, downloaded
#     into .whl-tpu/ (git-ignored);
#   - any other package is taken at the index's newest version that every requirement on it in the
#     closure allows and whose own requirements the other chosen versions meet; where none does, it
#     is carried at .venv's version;
#   - pyarrow (RELAX): jaxtune asks for 26.x, whose wheel alone (52 MiB) would not fit in the 64 MiB
#     that travels to the machine; the index's 25.0.1 is taken, which datasets (>=24) allows.
# EXACT=all carries every package at .venv's version (about 135 MiB: too large to travel).
# Writes .whl-tpu/requirements.txt, every name==version to install there, and prints what was
# carried, what was taken at another version than .venv's, and the total size.
#
#   benchmarks/tpu/tpu_wheels.sh          # here; then, there, from the repository's root (with .whl-tpu/):
#   source benchmarks/tpu/tpu_install.sh  # installs into /tmp/site, puts it and the repository on PYTHONPATH
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV_PYTHON=${VENV_PYTHON:-.venv/bin/python}   # the environment whose versions are taken
EXACT=${EXACT:-direct}                         # names carried at .venv's version; "direct": jaxtune's dependencies
RELAX=${RELAX:-pyarrow}                        # names on which jaxtune's own bound is not held
OUT=.whl-tpu
INDEX_DIRS=(/opt/pypi/files /opt/pypi-more/files /opt/wheels)
# On that machine already: the first five stay where they are (not installed again).
EXCLUDE="jax jaxlib libtpu numpy scipy pytest hypothesis sympy"

rm -rf "$OUT"
mkdir -p "$OUT"

# One line per package of the closure: name==version, the index's wheel or "-" (carried), .venv's
# version, and any requirement on it that the version breaks (none, or the script fails).
"$VENV_PYTHON" - "$EXCLUDE" "$RELAX" "$EXACT" "${INDEX_DIRS[@]}" >"$OUT/plan.tsv" <<'EOF'
import importlib.metadata as md
import os
import sys
import tomllib
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

exclude, relax, exact = ({canonicalize_name(n) for n in arg.split()} for arg in sys.argv[1:4])
index_dirs = sys.argv[4:]
installed = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}
roots = [Requirement(r) for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]]
if "direct" in exact:
    exact |= {canonicalize_name(r.name) for r in roots}
exact -= relax

# The wheels of the index that Python 3.11 takes on x86-64 Linux with glibc 2.36.
platforms = [f"manylinux_2_{n}_x86_64" for n in range(36, 4, -1)]
platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
supported = set(cpython_tags((3, 11), ["cp311"], platforms)) | set(compatible_tags((3, 11), "cp311", platforms))
index = {}  # name -> {version: path}
for folder in index_dirs:
    if os.path.isdir(folder):
        for file in sorted(os.listdir(folder)):
            try:
                name, version, _, tags = parse_wheel_filename(file)
            except InvalidWheelFilename:
                continue
            if tags & supported:
                index.setdefault(name, {}).setdefault(version, os.path.join(folder, file))


def venv_version(name):
    return Version(installed[name].version) if name in installed else None


def requires(name, version):
    """Requires-Dist of name==version: .venv's installed metadata, or the index wheel's."""
    if version == venv_version(name):
        return installed[name].requires or []
    with zipfile.ZipFile(index[name][version]) as wheel:
        meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(wheel.read(meta).decode()).get_all("Requires-Dist") or []


def applies(req, extra=""):
    return req.marker is None or req.marker.evaluate({"extra": extra})


choice = {}  # name -> the version taken
for _ in range(50):
    # Walk the closure from jaxtune's dependencies with the versions chosen so far.
    specs, extras_done, todo = {}, {}, [(r, "", "jaxtune") for r in roots]
    while todo:
        req, extra, parent = todo.pop()
        name = canonicalize_name(req.name)
        if not applies(req, extra) or name in exclude or name == "jaxtune":
            continue
        held = specs.setdefault(name, [])
        if not (parent == "jaxtune" and name in relax):
            held.append((req.specifier, parent))
        version = choice.setdefault(name, venv_version(name))
        if version is None:
            continue  # not in .venv: chosen from the index below
        done = extras_done.setdefault(name, set())
        for ex in ({""} | set(req.extras)) - done:
            done.add(ex)
            todo.extend((Requirement(r), ex, name) for r in requires(name, version))

    def allowed(name, version):
        if not all(spec.contains(version, prereleases=True) for spec, _ in specs[name]):
            return False
        for req in map(Requirement, requires(name, version)):
            dep = canonicalize_name(req.name)
            if applies(req) and choice.get(dep) is not None and not req.specifier.contains(choice[dep], prereleases=True):
                return False
        return True

    new = {}
    for name in specs:
        have = venv_version(name)
        if have is not None and (have in index.get(name, {}) or name in exact or "all" in exact):
            new[name] = have
            continue
        found = [v for v in index.get(name, {}) if not v.is_prerelease and allowed(name, v)]
        new[name] = max(found) if found else have
    if all(choice.get(n) == v for n, v in new.items()) and len(new) == len(choice):
        break
    choice = new
else:
    sys.exit("tpu_wheels.sh: the versions did not settle")

failed = False
for name in sorted(specs):
    version = choice[name]
    if version is None:
        sys.exit(f"tpu_wheels.sh: {name} is needed, and neither .venv nor the index has it")
    broken = [f"{spec} from {parent}" for spec, parent in specs[name] if not spec.contains(version, prereleases=True)]
    failed |= bool(broken)
    label = installed[name].metadata["Name"] if name in installed else name
    print(f"{label}=={version}\t{index.get(name, {}).get(version, '-')}\t{venv_version(name) or '-'}\t{'; '.join(broken)}")
if failed:
    sys.exit("tpu_wheels.sh: a version breaks a requirement (4th column of .whl-tpu/plan.tsv)")
EOF

cut -f1 "$OUT/plan.tsv" >"$OUT/requirements.txt"
carry=() other=()
while IFS=$'\t' read -r pin found venv _; do
    if [ "$found" = "-" ]; then carry+=("$pin"); fi
    if [ "${pin#*==}" != "$venv" ]; then other+=("${pin%%==*} ${pin#*==} (.venv: $venv)"); fi
done <"$OUT/plan.tsv"

if [ ${#carry[@]} -gt 0 ]; then
    platform_args=()
    for n in $(seq 36 -1 5); do platform_args+=(--platform "manylinux_2_${n}_x86_64"); done
    platform_args+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
    # (pip's warnings about names the local index lacks are dropped: those are the ones downloaded)
    "$VENV_PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.11 --implementation cp "${platform_args[@]}" -d "$OUT" "${carry[@]}" 2>"$OUT/pip.log" \
        || { cat "$OUT/pip.log" >&2; exit 1; }
    grep -v 'is neither a file nor a directory' "$OUT/pip.log" >&2 || true
    rm -f "$OUT/pip.log"
fi

echo "$(wc -l <"$OUT/requirements.txt") packages in $OUT/requirements.txt; from the index at another version than .venv's (${#other[@]}):"
printf '  %s\n' "${other[@]}"
echo "carried in $OUT/ (${#carry[@]} wheels):"
ls -1 "$OUT"/*.whl 2>/dev/null | sed 's|^|  |' || true
if compgen -G "$OUT/*.whl" >/dev/null; then du -ch "$OUT"/*.whl | tail -1; else echo "0 total"; fi
