"""A CPU build of llama-server and llama-bench with cmake, its output in a log file."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from runtime.errors import LivedraftError

TARGETS = ("llama-server", "llama-bench")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: no libllama.so / libggml*.so to find at run time
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # the server's web UI is downloaded from Hugging Face at build time; livedraft needs only its API,
    # and on a registry-only network each try waits for DNS to fail
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
# llama.cpp's AMX kernels, which -march=native compiles in wherever the CPU reports AMX, die of SIGILL
# at their first tile instruction on some machines (quantized models on a 2-core Xeon VM with AMX,
# llama.cpp 11434; upstream: ggml-org/llama.cpp PR 26954). They speed up prompt processing of large
# quantized models, which livedraft's targets do not need; every other kernel still fits the CPU.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_options(machine: str | None = None) -> tuple[str, ...]:
    """The configure options for this machine (`platform.machine()` unless given): on x86-64, the
    native build without AMX kernels (GCC lets an explicit -mno-* override -march=native)."""
    if (machine or platform.machine()).lower() in ("x86_64", "amd64"):
        return (*CMAKE_OPTIONS, f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
    return CMAKE_OPTIONS
_PERCENT = re.compile(r"^\[\s*(\d+)%\]")  # Makefile generator progress: "[ 42%] Building ..."


@dataclass(frozen=True)
class Toolchain:
    cmake: str
    make: str
    cc: str
    cxx: str


def find_toolchain(which: Callable[[str], str | None] = shutil.which) -> Toolchain:
    """cmake, make and C/C++ compilers on PATH, or an error that says what to install."""
    found = {
        "cmake": _first(which, ("cmake",), "cmake", "apt-get install cmake, or pip install cmake in the venv"),
        "make": _first(which, ("make",), "make", "apt-get install make"),
        "cc": _first(which, ("cc", "gcc", "clang"), "a C compiler", "apt-get install gcc"),
        "cxx": _first(which, ("c++", "g++", "clang++"), "a C++ compiler", "apt-get install g++"),
    }
    return Toolchain(**found)


def _first(which: Callable[[str], str | None], names: tuple[str, ...], what: str, how: str) -> str:
    for name in names:
        if path := which(name):
            return path
    raise LivedraftError(f"building llama.cpp needs {what} ({' or '.join(names)} on PATH) and found none: "
                         f"{how}; or set LIVEDRAFT_LLAMA_SERVER to a llama-server built elsewhere")


def build(source: Path, build_dir: Path, *, jobs: int, log_path: Path, tools: Toolchain,
          say: Callable[[str], None]) -> Path:
    """Configures and builds TARGETS out of tree; returns the directory holding the binaries."""
    _forget_other_source(build_dir, source)
    build_dir.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:  # one attempt per log: its first error is this attempt's
        say(f"configuring (cmake); log: {log_path}")
        _run([tools.cmake, "-S", str(source.resolve()), "-B", str(build_dir), *cmake_options()], log, log_path,
             "configure", say)
        say(f"building {', '.join(TARGETS)} with {jobs} job(s) (about 10 min on 2 cores)")
        _run([tools.cmake, "--build", str(build_dir), "--target", *TARGETS, "-j", str(jobs)], log, log_path,
             "build", say)
    bin_dir = build_dir / "bin"
    missing = [t for t in TARGETS if not (bin_dir / t).is_file()]
    if missing:
        raise LivedraftError(f"the llama.cpp build finished without {', '.join(missing)} in {bin_dir}: see {log_path}")
    return bin_dir


def _forget_other_source(build_dir: Path, source: Path) -> None:
    """cmake refuses a build tree configured for another source tree (an earlier attempt)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:") and Path(line.split("=", 1)[1]) != source.resolve():
            shutil.rmtree(build_dir)
            return


def _run(cmd: list[str], log: TextIO, log_path: Path, stage: str, say: Callable[[str], None]) -> None:
    """Runs `cmd`, every output line to the log, build progress to `say` in steps of 10 %."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    shown = -1
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        try:
            for line in proc.stdout:
                log.write(line)
                if (m := _PERCENT.match(line)) and (pct := int(m.group(1)) // 10 * 10) > shown:
                    shown = pct
                    say(f"build {pct}%")
        except BaseException:  # Ctrl-C or a full disk: leave no compiler running
            proc.kill()
            raise
    log.flush()
    if proc.returncode != 0:
        hint = first_error(log_path)
        raise LivedraftError(f"llama.cpp {stage} failed (cmake exit {proc.returncode}){': ' + hint if hint else ''}; "
                             f"full log: {log_path}")


def first_error(log_path: Path) -> str:
    """The first compiler/cmake error line in the log, for a one-line message."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        if "error:" in line.lower() or line.startswith("CMake Error"):
            return line.strip()[:300]
    return ""
