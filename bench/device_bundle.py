"""`make device-bundle`: a folder of wheels that lets the GPU image (Python 3.12, its own torch 2.11 with CUDA,
no network) run gpu_check: what gpu_check imports that the image lacks or has too old, at the versions of
requirements.lock, never torch, triton or CUDA libraries; with run-gpu-check.sh, which installs them with no
network and runs gpu_check with the image's python, and manifest.json (names, versions, sizes, why each).

    python -m bench.device_bundle [OUT]                      # for the GPU image (default OUT: dist/device-bundle)
    python -m bench.device_bundle OUT --for-python PYTHON    # for a local interpreter, as the test does
    python -m bench.device_bundle --verify                   # where it was installed: every requirement met?

What is carried is decided in bench/bundle_needs.py. Wheels come from PyPI through `pip download --no-deps
--only-binary=:all:` for the target's Python and platforms; a wheel already in OUT is reused.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from collections import defaultdict
from email.parser import Parser
from pathlib import Path

from bench.bundle_needs import (
    GPU_IMAGE,
    LEFT_OUT,
    MANYLINUX,
    NEEDS,
    NEVER,
    ROOT,
    Pick,
    Target,
    applies,
    canon,
    decide,
    meets,
    project_requirements,
    read_lock,
    verify,
)

LIMIT_BYTES = 64 << 20  # what one device call carries beside the tree (/work/.library/device/README.md)
SCRIPT = "run-gpu-check.sh"
NOT_RECORDED = "(version not recorded)"
RUN_SCRIPT = """#!/usr/bin/env bash
# Installs this folder's wheels with no network and runs gpu_check with the image's python (written by
# `python -m bench.device_bundle`). Run from the repository root:  bash {out}/{script} [gpu_check args]
# The wheels go to $BUNDLE_ENV/site; a venv there sees them first, then the image's own packages (its .pth),
# so every process gpu_check starts (sys.executable) has them whatever PYTHONPATH it is given.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${{PYTHON:-python3}}
ENV=${{BUNDLE_ENV:-/tmp/dflash-bundle}}
[ -f bench/gpu_check.py ] || {{ echo "run-gpu-check.sh: run it from the repository root" >&2; exit 2; }}
"$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$ENV/site" "$HERE"/*.whl
if "$PY" -m venv --without-pip --clear "$ENV/venv" 2>/dev/null; then
  PTH=$("$ENV/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/dflash-bundle.pth
  "$PY" -c "import sys; s = [sys.argv[1], *(p for p in sys.path if p.endswith('-packages'))]
print('import site; ' + '; '.join('site.addsitedir(%r)' % p for p in s))" "$ENV/site" >"$PTH"
  PY=$ENV/venv/bin/python
  export PYTHONPATH="$PWD"
else  # no venv module: the bundle by PYTHONPATH (a child that replaces PYTHONPATH will not see it)
  export PYTHONPATH="$ENV/site:$PWD"
fi
echo "device bundle: {count} wheels installed into $ENV/site; python: $PY"
"$PY" -m bench.device_bundle --verify || echo "device bundle: requirements unmet (above); gpu_check runs anyway"
exec "$PY" -m bench.gpu_check "$@"
"""


def local_target(python: str) -> Target:
    """A local interpreter as a bundle target: its version, and its installed distributions as present."""
    code = (
        "import importlib.metadata as m, json, platform;"
        "print(json.dumps([platform.python_version(), {d.metadata['Name']: d.version for d in m.distributions()}]))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    version, present = json.loads(out)
    return Target(f"{python} (CPython {version})", version, MANYLINUX, {canon(k): v for k, v in present.items()})


def download(picks: list[Pick], target: Target, out: Path) -> None:
    """The picks' wheels into `out` (pip reuses one already there), for the target's Python and platforms."""
    if not picks:
        return
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out)]
    cmd += ["--python-version", target.python_version, "--implementation", "cp"]
    cmd += [a for p in target.platforms for a in ("--platform", p)]
    run = subprocess.run(cmd + [f"{p.name}=={p.version}" for p in picks], capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"device bundle: pip download failed for {target.label}: {' / '.join(tail)}")


def wheel_of(out: Path, name: str, version: str) -> Path:
    found = [w for w in out.glob("*.whl") if canon(w.name.split("-")[0]) == name and w.name.split("-")[1] == version]
    if len(found) != 1:
        raise SystemExit(f"device bundle: expected one wheel of {name}=={version} in {out}, found {found}")
    return found[0]


def wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []


def resolve(target: Target, lock: dict[str, str], out: Path) -> dict[str, Pick]:
    """Walk the requirements from NEEDS: each distribution reached is kept as the target has it or carried at
    the lock's version (its wheel downloaded and its own requirements walked in turn)."""
    from packaging.requirements import Requirement

    env = target.marker_env()
    project = project_requirements()
    pending = [(Requirement(r), "pyproject.toml") for n in NEEDS for r in project[n]]
    reqs: dict[str, list] = defaultdict(list)
    by: dict[str, str] = {}
    picks: dict[str, Pick] = {}
    while pending:
        touched = set()
        for req, src in pending:
            name = canon(req.name)
            if applies(req, env) and not NEVER.match(name):
                reqs[name].append(req)
                by.setdefault(str(req), src)
                touched.add(name)
        new = []
        for name in sorted(touched):
            if name in picks and picks[name].carried:
                continue
            picks[name] = decide(name, reqs[name], target, lock, by)
            new += [picks[name]] if picks[name].carried else []
        download(new, target, out)
        pending = [
            (Requirement(r), f"{p.name} {p.version}")
            for p in new
            for r in wheel_requires(wheel_of(out, p.name, p.version))
        ]
    for name, pick in picks.items():
        unmet = [str(r) for r in reqs[name] if pick.carried and not meets(pick.version, r)]
        if unmet:
            raise SystemExit(f"device bundle: the lock's {name}=={pick.version} does not meet {unmet[0]}")
    return picks


def build(out: Path, target: Target = GPU_IMAGE, lock_path: Path = ROOT / "requirements.lock") -> dict:
    """The bundle in `out`: the carried wheels (no others: two versions of one stop the install), the run
    script and manifest.json; refused when over LIMIT_BYTES."""
    out.mkdir(parents=True, exist_ok=True)
    picks = resolve(target, read_lock(lock_path), out)
    carried = sorted((p for p in picks.values() if p.carried), key=lambda p: p.name)
    wheels = {p.name: wheel_of(out, p.name, p.version) for p in carried}
    for stale in set(out.glob("*.whl")) - set(wheels.values()):
        stale.unlink()
    total = sum(w.stat().st_size for w in wheels.values())
    if total > LIMIT_BYTES:
        big = sorted(wheels.values(), key=lambda w: -w.stat().st_size)[:3]
        raise SystemExit(
            f"device bundle: {total / 2**20:.1f} MiB is over the {LIMIT_BYTES >> 20} MiB a device call carries;"
            f" largest: {', '.join(f'{w.name} {w.stat().st_size / 2**20:.1f} MiB' for w in big)}"
        )
    manifest = {
        "target": target.label,
        "lock": str(lock_path),
        "wheels": [
            {
                "name": p.name,
                "version": p.version,
                "file": wheels[p.name].name,
                "bytes": wheels[p.name].stat().st_size,
                "why": p.why,
            }
            for p in carried
        ],
        "total_bytes": total,
        "kept": {p.name: p.version for p in picks.values() if not p.carried},
        "left_out": LEFT_OUT,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    script = out / SCRIPT
    script.write_text(RUN_SCRIPT.format(out=_shown(out), script=SCRIPT, count=len(carried)))
    script.chmod(0o755)
    return manifest


def _shown(out: Path) -> str:
    try:
        return str(out.resolve().relative_to(ROOT))
    except ValueError:
        return str(out)


def summary(manifest: dict) -> str:
    kept = sorted(manifest["kept"].items())
    rows = [
        f"  {w['name']:22s} {w['version']:12s} {w['bytes'] / 2**20:6.2f} MiB  {w['why']}" for w in manifest["wheels"]
    ]
    return "\n".join(
        [
            f"device bundle for {manifest['target']}: {len(rows)} wheels, {manifest['total_bytes'] / 2**20:.2f} MiB"
            f" (limit {LIMIT_BYTES >> 20} MiB), no torch, triton or CUDA library",
            *rows,
            f"  kept as the target has them: {', '.join(f'{k} {v or NOT_RECORDED}' for k, v in kept)}",
            f"  left out (gpu_check does not import them): {', '.join(sorted(manifest['left_out']))}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.device_bundle", description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path, default=ROOT / "dist" / "device-bundle")
    ap.add_argument("--lock", type=Path, default=ROOT / "requirements.lock", help="the locked versions")
    ap.add_argument("--for-python", help="build for this local interpreter instead of the GPU image")
    ap.add_argument("--verify", action="store_true", help="check the installed closure's requirements here")
    args = ap.parse_args(argv)
    if args.verify:
        problems = verify()
        for p in problems:
            print(f"device bundle: {p}", file=sys.stderr)
        print(f"device bundle: {'requirements met' if not problems else f'{len(problems)} requirement(s) unmet'}")
        return 1 if problems else 0
    target = local_target(args.for_python) if args.for_python else GPU_IMAGE
    manifest = build(args.out, target, args.lock)
    print(summary(manifest))
    print(f"then, on the GPU machine, from the repository root: bash {_shown(args.out)}/{SCRIPT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
