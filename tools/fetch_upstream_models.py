"""Fetch the models other projects wrote that tests/test_upstream_models.py trains unedited, into
``.cache/upstream/`` (ignored by git: their code is never committed here).

* flax's lm1b Transformer (``examples/lm1b/models.py``) ships in flax's PyPI source distribution, not
  in its wheel. ``pip download`` fetches the sdist of the flax version pyproject.toml pins, its sha256
  is checked, and only ``examples/lm1b/models.py`` and ``LICENSE`` are extracted, to
  ``.cache/upstream/flax-<version>/``. `.ci/run` runs this before the suite; a failed download or a
  hash mismatch exits 1 there with one line saying what failed.
* big_vision is on no package registry. ``--big-vision [GIT_SOURCE]`` clones it (default: GitHub; a
  local clone or mirror works too) and extracts, at a pinned commit, only the files its ViT needs into
  ``.cache/upstream/big_vision/``; point ``MESHTRAIN_BIG_VISION`` at that folder to run its tests.

Usage::

    python tools/fetch_upstream_models.py                 # flax's lm1b (CI does this)
    python tools/fetch_upstream_models.py --big-vision    # and big_vision (needs git and GitHub)
    MESHTRAIN_BIG_VISION=.cache/upstream/big_vision python -m pytest tests/test_upstream_models.py

Only the standard library and pip: it runs in a fresh virtual environment before anything is installed.
"""

import argparse
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "upstream")

#: must equal pyproject.toml's flax pin (checked); the hash is PyPI's for flax-<version>.tar.gz
FLAX_VERSION = "0.12.8"
FLAX_SDIST_SHA256 = "1bb438775b967a3f1f42b9c3d4ddf1d2883cd6406589f9cecdc244634036bdc4"
FLAX_FILES = ("examples/lm1b/models.py", "LICENSE")

BIG_VISION_GIT = "https://github.com/google-research/big_vision"
BIG_VISION_COMMIT = "0127fb6b337ee2a27bf4e54dea79cff176527356"  # 2025-05-19
# vit.py imports big_vision.utils too, but only to load checkpoints; that module needs tensorflow (the
# tests stand in an empty module for it when it does not import)
BIG_VISION_FILES = ("LICENSE", "big_vision/__init__.py", "big_vision/models/__init__.py",
                    "big_vision/models/common.py", "big_vision/models/vit.py")
STAMP = "FETCHED"


class FetchError(Exception):
    """One line: what failed and what to do."""


def flax_dir(cache: str = CACHE) -> str:
    return os.path.join(cache, f"flax-{FLAX_VERSION}")


def lm1b_models_path(cache: str = CACHE) -> str:
    return os.path.join(flax_dir(cache), "examples", "lm1b", "models.py")


def pinned_flax_version(pyproject: str = os.path.join(ROOT, "pyproject.toml")) -> str:
    with open(pyproject) as f:
        m = re.search(r'"flax==([^"]+)"', f.read())
    if not m:
        raise FetchError(f"{pyproject}: no \"flax==VERSION\" pin found")
    return m.group(1)


def _done(folder: str, stamp: str) -> bool:
    try:
        with open(os.path.join(folder, STAMP)) as f:
            return f.read().strip() == stamp
    except OSError:
        return False


def _install(files: dict, folder: str, stamp: str) -> None:
    """Write ``{relative path: bytes}`` to a fresh ``folder`` (replaced whole, so no stale file stays)."""
    tmp = folder + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
        with open(os.path.join(tmp, rel), "wb") as f:
            f.write(data)
    with open(os.path.join(tmp, STAMP), "w") as f:
        f.write(stamp + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def fetch_flax(cache: str = CACHE) -> str:
    pinned = pinned_flax_version()
    if pinned != FLAX_VERSION:
        raise FetchError(f"pyproject.toml pins flax=={pinned} but tools/fetch_upstream_models.py fetches "
                         f"{FLAX_VERSION}: set FLAX_VERSION and FLAX_SDIST_SHA256 (PyPI's sha256 of "
                         f"flax-{pinned}.tar.gz) there")
    folder = flax_dir(cache)
    if _done(folder, FLAX_SDIST_SHA256):
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"flax=={FLAX_VERSION}", "--no-binary", ":all:",
               "--no-deps", "--disable-pip-version-check", "-q", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdist = os.path.join(tmp, f"flax-{FLAX_VERSION}.tar.gz")
        if proc.returncode != 0 or not os.path.exists(sdist):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise FetchError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}): {tail}")
        with open(sdist, "rb") as f:
            data = f.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != FLAX_SDIST_SHA256:
        raise FetchError(f"flax-{FLAX_VERSION}.tar.gz has sha256 {digest}, expected {FLAX_SDIST_SHA256}")
    prefix = f"flax-{FLAX_VERSION}/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        files = {rel: tar.extractfile(prefix + rel).read() for rel in FLAX_FILES}
    _install(files, folder, FLAX_SDIST_SHA256)
    return folder


def fetch_big_vision(source: str = BIG_VISION_GIT, cache: str = CACHE) -> str:
    folder = os.path.join(cache, "big_vision")
    if _done(folder, BIG_VISION_COMMIT):
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        clone = os.path.join(tmp, "repo")
        steps = [["git", "clone", "--quiet", "--bare", "--filter=blob:none", source, clone],
                 ["git", "--git-dir", clone, "archive", "--format=tar", BIG_VISION_COMMIT, *BIG_VISION_FILES]]
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True)
            if proc.returncode != 0:
                tail = (proc.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
                raise FetchError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {tail}")
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        files = {rel: tar.extractfile(rel).read() for rel in BIG_VISION_FILES}
    _install(files, folder, BIG_VISION_COMMIT)
    return folder


def import_big_vision_vit(root: str):
    """``big_vision.models.vit`` from the checkout at ``root`` (as ``fetch_big_vision`` leaves it), unedited.
    vit.py imports big_vision.utils only to load checkpoints, and that module needs tensorflow, so where it
    does not import an empty module stands in for it (the model never touches it)."""
    import sys
    import types

    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        import big_vision.utils  # noqa: F401
    except ImportError:
        sys.modules["big_vision.utils"] = types.ModuleType("big_vision.utils")
    from big_vision.models import vit
    return vit


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big-vision", nargs="?", const=BIG_VISION_GIT, metavar="GIT_SOURCE",
                        help=f"also fetch big_vision at {BIG_VISION_COMMIT[:12]} (default source {BIG_VISION_GIT})")
    parser.add_argument("--cache", default=CACHE, help="where to put them (default .cache/upstream)")
    args = parser.parse_args(argv)
    try:
        print(f"flax's lm1b example: {fetch_flax(args.cache)}")
        if args.big_vision:
            print(f"big_vision: {fetch_big_vision(args.big_vision, args.cache)} "
                  f"(MESHTRAIN_BIG_VISION=that folder runs its tests)")
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
