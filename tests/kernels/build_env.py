"""Unpack the kernel distributions ``make test-kernels`` downloaded (their Python layer only).

Usage: ``python tests/kernels/build_env.py DOWNLOADS DISTS``. Every wheel or
sdist in DOWNLOADS (fetched with ``pip download --no-deps``) is unpacked into
``DISTS/<project>/``, Python files only: no compiled extension (xformers'
``_C.so``), no CUDA sources. flash-attn's sdist gives two folders:
``flash-attn`` (the ``flash_attn`` package) and ``flash-attn-3`` (its
``hopper/flash_attn_interface.py``, the FlashAttention-3 interface of the same
release, which has no distribution of its own on the registry). amd-aiter
gets an empty ``aiter/jit/aiter_.so``: the file a prebuilt install has (the
tests put stubs/aiter_.py in its place). torch-npu's Python files are unpacked
too, but never imported: ``npu_fusion_attention`` is a compiled operator, and
the stand-in in stubs/npu reads its published schema from
``torch_npu/_op_plugin_docs.py``. Nothing here
is committed: the Makefile downloads the distributions at set-up.
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from pathlib import Path

#: the non-Python files a wrapper reads at import: aiter.jit.core (install or develop
#: mode) and aiter/ops/attention.py (paged-attention templates, read at import)
_DATA = ("aiter/install_mode", "aiter_meta/csrc/cpp_itfs/")


def _project(archive: Path) -> str:
    name = archive.name.removesuffix(".tar.gz").removesuffix(".whl")
    return name.split("-")[0].replace("_", "-").lower()


def _write(dists: Path, project: str, member: str, data: bytes) -> None:
    target = dists / project / member
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def unpack(downloads: Path, dists: Path) -> list[str]:
    done = []
    for archive in sorted(downloads.iterdir()):
        project = _project(archive)
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as wheel:
                for member in wheel.namelist():
                    wanted = member.endswith(".py") or member.startswith(_DATA)
                    if wanted and ".dist-info/" not in member:
                        _write(dists, project, member, wheel.read(member))
        elif archive.name.endswith(".tar.gz"):
            with tarfile.open(archive) as sdist:
                for info in sdist.getmembers():
                    parts = info.name.split("/", 1)
                    if len(parts) < 2 or not info.isfile() or not parts[1].endswith(".py"):
                        continue
                    path = parts[1]
                    handle = sdist.extractfile(info)
                    assert handle is not None
                    if path.startswith(f"{project.replace('-', '_')}/"):
                        _write(dists, project, path, handle.read())
                    elif project == "flash-attn" and path == "hopper/flash_attn_interface.py":
                        _write(dists, "flash-attn-3", "flash_attn_interface.py", handle.read())
        else:
            continue
        done.append(archive.name)
    aiter_jit = dists / "amd-aiter" / "aiter" / "jit"
    if aiter_jit.is_dir():
        # a prebuilt aiter install has aiter/jit/aiter_.so; aiter.jit.core looks for the
        # file and then imports aiter.jit.aiter_, which the tests map to stubs/aiter_.py
        (aiter_jit / "aiter_.so").write_bytes(b"")
    return done


if __name__ == "__main__":
    for name in unpack(Path(sys.argv[1]), Path(sys.argv[2])):
        print("unpacked", name)
