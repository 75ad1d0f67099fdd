"""CI check of the packaging: build the sdist, build the wheel from it, install the wheel into a fresh virtual
environment, and check that the sdist and the wheel hold the kernel sources, the wheel (where nvcc exists, or with
--require-library) the prebuilt kernel library, and that the installed package imports from the environment (not
from this checkout) and loads that library's C ABI.

    python tools/check_wheel.py [--require-library] [--keep DIR]

The environment sees this Python's site-packages (torch, transformers: nothing is downloaded) and gets only the
wheel itself. The prebuilt library is loaded with ctypes, its ABI version and its parameter structs' layout checked
against the binding's (hf_cascade/kernels/cuda_binding.py); no GPU is needed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "hf_cascade/kernels/libhfc_kernels.so"
SOURCES = ("hf_cascade/csrc/api.cu", "hf_cascade/csrc/prefix.cu", "hf_cascade/csrc/suffix.cu",
           "hf_cascade/csrc/merge.cu", "hf_cascade/csrc/include/hfc/params.h", "hf_cascade/csrc/include/hfc/api.h",
           "hf_cascade/csrc/include/hfc/common.cuh", "hf_cascade/csrc/include/hfc/dispatch.h",
           "hf_cascade/csrc/include/hfc/layout.h", "hf_cascade/csrc/include/hfc/errors.h",
           "hf_cascade/kernels/_build.py", "hf_cascade/kernels/ops.py", "hf_cascade/patches/__init__.py")

# runs inside the fresh environment, from an empty directory
PROBE = r"""
import sys
from pathlib import Path
import hf_cascade
from hf_cascade.kernels import _build, cuda
env, require = Path(sys.argv[1]).resolve(), sys.argv[2] == "1"
where = Path(hf_cascade.__file__).resolve()
assert env in where.parents, f"hf_cascade imported from {where}, not from the wheel's environment {env}"
csrc = _build.find_csrc()
assert csrc is not None and env in csrc.resolve().parents, f"kernel sources at {csrc}"
if cuda.PREBUILT.is_file():
    lib = cuda._Lib(cuda.PREBUILT)          # raises unless the ABI version and the structs' layout match
    print(f"prebuilt library loads, ABI {lib.lib.hfc_abi_version()}, struct layout checked: {cuda.PREBUILT}")
    # the C side's argument checks answer before any CUDA call (no GPU here): the structs arrive intact
    import ctypes
    def prefix(**kw):
        p = dict(R=4, Lq=1, Hq=8, Hkv=2, block_size=16, G=1, Rg=4, Mp=2, chunk_tokens=64, max_chunks=1, row_tiles=1,
                 scale_log2=0.1, dtype=0, head_dim=128, m_tile=16)
        return lib.lib.hfc_prefix(ctypes.byref(cuda._PrefixParams(**{**p, **kw})), 0)
    def suffix(**kw):
        p = dict(R=4, Lq=1, Hq=8, Hkv=2, block_size=16, Ms=2, split_tokens=32, nsplit=1, slot0=1, scale_log2=0.1,
                 dtype=0, head_dim=128)
        return lib.lib.hfc_suffix(ctypes.byref(cuda._SuffixParams(**{**p, **kw})), 0)
    def merge(**kw):
        p = dict(R=4, Lq=1, Hq=8, slot0=1, nsplit=1, dtype=0, head_dim=128)
        return lib.lib.hfc_merge(ctypes.byref(cuda._MergeParams(**{**p, **kw})), 0)
    INVALID = 1   # cudaErrorInvalidValue
    answers = {"prefix R=0": (prefix(R=0), 0), "prefix Rg > row_tiles x m_tile": (prefix(Rg=5), INVALID),
               "prefix m_tile 64, head_dim 256": (prefix(m_tile=64, head_dim=256), INVALID),
               "prefix dtype 2": (prefix(dtype=2), INVALID), "prefix Hq % Hkv": (prefix(Hq=7), INVALID),
               "suffix R=0": (suffix(R=0), 0), "suffix nsplit 0": (suffix(nsplit=0), INVALID),
               "suffix head_dim 96": (suffix(head_dim=96), INVALID), "merge R=0": (merge(R=0), 0),
               "merge slot0 -1": (merge(slot0=-1), INVALID)}
    wrong = {k: v for k, v in answers.items() if v[0] != v[1]}
    assert not wrong, f"C argument checks answered (got, want): {wrong}"
    suffix(head_dim=96)                     # a dispatch refusal says which value and which are compiled
    said = lib.lib.hfc_last_error().decode()
    assert "head_dim 96" in said and "64, 128, 256" in said, f"hfc_last_error after head_dim 96: {said!r}"
    print(f"C argument checks: {len(answers)} answers as expected")
else:
    assert not require, "the wheel has no prebuilt kernel library"
print("availability:", cuda.availability())
print("import OK:", where)
"""


def run(cmd, **kw):
    print("+", " ".join(str(c) if len(str(c)) < 200 else "<script>" for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--require-library", action="store_true",
                    help="fail unless the wheel holds the prebuilt kernel library (CI has nvcc)")
    ap.add_argument("--keep", type=Path, help="build and install under this directory and keep it")
    args = ap.parse_args()
    tmp = args.keep or Path(tempfile.mkdtemp(prefix="hfc_wheel_"))
    tmp.mkdir(parents=True, exist_ok=True)

    start = time.monotonic()
    try:   # the builds below run without isolation: they need these in this Python (a fresh CI Python may lack them)
        import setuptools  # noqa: F401
        import wheel  # noqa: F401
    except ImportError:
        run([sys.executable, "-m", "pip", "install", "-q", "setuptools>=64", "wheel"])
    run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp / "sdist")], cwd=ROOT)
    sdists = sorted((tmp / "sdist").glob("hf_cascade-*.tar.gz"))
    if len(sdists) != 1:
        print(f"check_wheel: expected one sdist, found {sdists}")
        return 1
    in_sdist = {n.split("/", 1)[1] for n in tarfile.open(sdists[0]).getnames() if "/" in n}
    lacking = [n for n in ("csrc/api.cu", "csrc/prefix.cu", "csrc/suffix.cu", "csrc/merge.cu", "setup.py",
                           "csrc/include/hfc/params.h", "hf_cascade/kernels/_build.py") if n not in in_sdist]
    if lacking:
        print(f"check_wheel: FAIL: the sdist lacks {lacking}")
        return 1
    env = {**os.environ, "HF_CASCADE_BUILD_KERNELS": "1"} if args.require_library else None
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
         str(sdists[0])], env=env)
    built = time.monotonic() - start
    wheels = sorted((tmp / "dist").glob("hf_cascade-*.whl"))
    if len(wheels) != 1:
        print(f"check_wheel: expected one wheel, found {wheels}")
        return 1
    wheel = wheels[0]
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [n for n in SOURCES if n not in names]
    has_lib = LIBRARY in names
    print(f"check_wheel: {wheel.name}: {len(names)} files, built in {built:.0f} s, "
          f"prebuilt library: {'yes' if has_lib else 'no'}")
    if missing:
        print(f"check_wheel: FAIL: the wheel lacks {missing}")
        return 1
    if args.require_library and not has_lib:
        print(f"check_wheel: FAIL: the wheel lacks {LIBRARY}")
        return 1
    if has_lib and "-py3-none-any" in wheel.name:
        print("check_wheel: FAIL: a wheel with a compiled library must carry a platform tag")
        return 1

    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    py = venv / "bin" / "python"
    # --ignore-installed: this Python may hold an (editable) hf_cascade already; the venv must get the wheel's
    run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)])
    probe_dir = tmp / "probe"
    probe_dir.mkdir(exist_ok=True)
    run([py, "-c", PROBE, str(venv), "1" if (args.require_library or has_lib) else "0"], cwd=probe_dir)
    print(f"check_wheel: OK in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
