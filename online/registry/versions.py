"""MLflow adapter: each training round is a run; each candidate a version of one registered model.

Default stores live in the data directory: tracking + registry in
`sqlite:///<data_dir>/mlflow.db`, artifacts under `<data_dir>/mlartifacts` —
never the project's own database. Aliases carry the serving decision:
`champion` is what the runtime loads (`models:/<name>@champion`), `previous`
is where a rollback returns to, `trainee` (with `trainer.lineage = "trainee"`)
is what the next round trains from. Versions are tagged with their parent version,
data window, target model, loss and eval metrics.

mlflow is imported lazily (inside this module's functions), so `import online`
stays light; every call here blocks on the tracking store (a local SQLite
write, or an HTTP request to a tracking server).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from online.config import Config
from runtime.errors import LivedraftError
from runtime.loader import OPTIMIZER_STATE, read_drafter_meta

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from online.trainer.round import RoundResult

log = logging.getLogger(__name__)

CHAMPION = "champion"
PREVIOUS = "previous"
TRAINEE = "trainee"  # trainer.lineage = "trainee": the version the next round trains from, promoted or not
DRAFTER_ARTIFACTS = "drafter"  # artifact sub-path holding the drafter directory
SPECULATORS_ARTIFACTS = "speculators"  # eagle versions: the same head as vLLM loads it (speculators Eagle3)
RUN_MARKER = ".livedraft-run"  # in a downloaded version's directory: the id of the run that logged it
PRUNE_GRACE_S = 600.0  # prune_cache leaves what changed more recently: another process may be loading it
GGUF_ARTIFACT = "gguf/head.gguf"  # eagle versions with a known target: the head as llama-server loads it (-md)


class RegistryError(LivedraftError):
    """The registry cannot do what was asked (no champion yet, bad settings); the message says what to do."""


@dataclass
class RegistrySettings:
    tracking_uri: str
    registry_uri: str
    artifact_root: str  # a URI (file:///... for the local default)
    experiment: str
    model_name: str
    cache_dir: Path  # downloaded versions: <cache_dir>/<model_name>/v<N>
    keep_cached: int = 4  # prune_cache keeps this many newest downloads beyond those an alias names (0: all)

    @classmethod
    def from_config(cls, cfg: Config) -> RegistrySettings:
        """Resolves the empty defaults of [registry] against the data directory."""
        r, data = cfg.registry, cfg.data_path
        tracking = r.tracking_uri or f"sqlite:///{data / 'mlflow.db'}"
        if tracking == cfg.store_url():
            raise RegistryError(f"[registry] tracking_uri {tracking} is the project's own database: MLflow keeps "
                                "its own schema and migrations; point it at another database (or leave it empty)")
        if "'" in r.model_name:
            raise RegistryError(f"[registry] model_name {r.model_name!r} must not contain a quote")
        return cls(tracking, r.registry_uri or tracking, _as_uri(r.artifact_root or str(data / "mlartifacts")),
                   r.experiment, r.model_name, Path(r.cache_dir or data / "drafters").expanduser(), r.keep_cached)


@dataclass
class LocalDrafter:
    version: int
    path: Path  # a drafter directory: load it with runtime.drafters.factory.load_drafter


@dataclass
class LoggedRound:
    run_id: str
    version: int
    promoted: bool


@dataclass
class VersionInfo:
    """One registered drafter version (what GET /v1/drafter lists)."""

    version: int
    aliases: list[str]
    tags: dict[str, str]
    run_id: str | None
    source: str
    created_at: float  # unix seconds

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class DrafterRegistry:
    """The drafter registry over one MLflow tracking + registry store. Not thread-safe for writes:
    one trainer writes; any number of readers (`champion_version`, `history`) may poll."""

    def __init__(self, settings: RegistrySettings) -> None:
        self.settings = settings
        self.name = settings.model_name
        self._client: MlflowClient | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> DrafterRegistry:
        return cls(RegistrySettings.from_config(cfg))

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
            os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
            from mlflow import MlflowClient

            for uri in {self.settings.tracking_uri, self.settings.registry_uri}:
                ensure_sqlite_dir(uri)
            self._client = MlflowClient(tracking_uri=self.settings.tracking_uri,
                                        registry_uri=self.settings.registry_uri)
        return self._client

    def bootstrap(self, initial_drafter_dir: str | os.PathLike, *, target_model: str = "") -> int:
        """Registers `initial_drafter_dir` as version 1 and champion unless the model already has a
        champion; returns the champion version either way."""
        current = self.champion_version()
        if current is not None:
            return current
        return self.register(initial_drafter_dir, alias=CHAMPION, target_model=target_model, kind="bootstrap")

    def register(self, drafter_dir: str | os.PathLike, *, alias: str | None = None, target_model: str = "",
                 kind: str = "register") -> int:
        """Logs `drafter_dir` (a model or eagle drafter directory) as a run and registers it as a new
        version; with `alias` "champion" it is promoted (the old champion becomes `previous`), with
        another alias that alias is set. Returns the version. Raises RegistryError for a directory
        that is not a drafter."""
        from runtime.drafters.factory import drafter_kind

        src = Path(drafter_dir)
        if not (src / "config.json").is_file():
            raise RegistryError(f"{src} is not a drafter directory (no config.json): make one with "
                                "`livedraft drafter init` (or `drafter train`)")
        meta = read_drafter_meta(src)
        run = self._start_run(kind, {"livedraft.kind": kind})
        try:
            self._log_drafter(run.info.run_id, src, target_model)
            version = self._register(run, {"kind": kind, "source_dir": str(src.resolve()),
                                           "drafter_version": str(meta.get("version", src.name)),
                                           "drafter_kind": drafter_kind(src), "target_model": target_model})
        except BaseException:
            self.client.set_terminated(run.info.run_id, "FAILED")
            raise
        self.client.set_terminated(run.info.run_id)
        if alias == CHAMPION:
            self.promote(version)
        elif alias:
            self.client.set_registered_model_alias(self.name, alias, str(version))
        log.info("registry: registered %s as %s version %d%s", src, self.name, version,
                 f" ({alias})" if alias else "")
        return version

    def rollback(self, reason: str = "manual rollback") -> int:
        """Moves `champion` back to `previous` and tags the version it leaves. Returns the new
        champion. Raises RegistryError when there is no champion or no previous version."""
        champion, previous = self.champion_version(), self._alias(PREVIOUS)
        if champion is None:
            raise RegistryError(f"{self.name} has no {CHAMPION!r} version to roll back")
        if previous is None:
            raise RegistryError(f"{self.name} version {champion} has no {PREVIOUS!r} version to return to: "
                                "promote a version instead (`livedraft drafter promote N`)")
        back = self.tag_rolled_back(champion, {}, reason=reason)
        return back if back is not None else champion

    def local(self, ref: str) -> LocalDrafter:
        """A registry reference — a version number, an alias, or an MLflow model URI
        (models:/<name>/<version>, models:/<name>@<alias>) — downloaded. Raises RegistryError."""
        name, sel = self.name, ref
        if ref.startswith("models:/"):
            body = ref[len("models:/"):]
            name, sep, sel = body.partition("@") if "@" in body else body.partition("/")
            if not sep or not name or not sel:
                raise RegistryError(f"{ref!r}: expected models:/<name>/<version> or models:/<name>@<alias>")
        reg = self if name == self.name else DrafterRegistry(dataclasses.replace(self.settings, model_name=name))
        if sel.isdigit():
            version = int(sel)
        else:
            version = reg._alias(sel)
            if version is None:
                raise RegistryError(f"registered model {name!r} has no alias {sel!r} (see `livedraft drafter list`)")
        return LocalDrafter(version, reg.download(version))

    def acceptance_per_position(self, version: int) -> list[float] | None:
        """The replay gate's acceptance per draft position for `version` (its round's candidate
        metrics), or None for a version no round measured (bootstrapped, registered by hand)."""
        run_id = self.client.get_model_version(self.name, str(version)).run_id
        if not run_id:
            return None
        history = self.client.get_metric_history(run_id, "candidate_acceptance_per_position")
        return [m.value for m in sorted(history, key=lambda m: m.step)] or None

    def log_serving(self, version: int, metrics: dict[str, float]) -> None:
        """Adds serving facts (swap time, requests served, the engine's draft rule) to the run of
        `version`, stepped by the time they were measured so repeated swaps keep a history."""
        run_id = self.client.get_model_version(self.name, str(version)).run_id
        if run_id:
            step = int(time.time())
            for key, value in metrics.items():
                self.client.log_metric(run_id, key, float(value), step=step)

    def champion_version(self) -> int | None:
        """The version under alias `champion`, or None. Cheap: one store read, no download."""
        return self._alias(CHAMPION)

    def champion(self) -> LocalDrafter:
        """The champion, downloaded into the local cache. Raises RegistryError when there is none."""
        version = self.champion_version()
        if version is None:
            raise RegistryError(f"registered model {self.name!r} has no {CHAMPION!r} alias: bootstrap the registry "
                                "with an initial drafter first (DrafterRegistry.bootstrap)")
        return LocalDrafter(version, self.download(version))

    def trainee_version(self) -> int | None:
        """The version under alias `trainee` (what the next round trains from), or None."""
        return self._alias(TRAINEE)

    def set_trainee(self, version: int | None) -> None:
        """Moves `trainee` to `version`; None removes it (the next round trains from the champion)."""
        if version is not None:
            self.client.set_registered_model_alias(self.name, TRAINEE, str(version))
        elif self._alias(TRAINEE) is not None:
            self.client.delete_registered_model_alias(self.name, TRAINEE)

    def download(self, version: int) -> Path:
        """The drafter directory of `version`, from the cache or downloaded (atomically) into it. A
        cached directory counts only if it holds this version's run id (RUN_MARKER): a registry
        started again (a new tracking database beside the same data directory) numbers its
        versions from 1 again, and must not be served the old registry's. Raises RegistryError for
        a version the registry does not have."""
        dst = self.settings.cache_dir / self.name / f"v{version}"
        run_id = self._run_id(version)
        if (dst / "config.json").is_file():
            if _run_marker(dst) == run_id:
                return dst
            log.info("registry: the cached %s is not version %d of this registry (run %s): downloading it anew",
                     dst, version, run_id)
            stale = Path(tempfile.mkdtemp(prefix=f".v{version}-stale-", dir=dst.parent))
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                os.replace(dst, stale / dst.name)
            shutil.rmtree(stale, ignore_errors=True)
        import mlflow.artifacts

        uri = self.client.get_model_version_download_uri(self.name, str(version))
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=dst.parent))
        try:
            local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp),
                                                        tracking_uri=self.settings.tracking_uri)
            (Path(local) / RUN_MARKER).write_text(run_id)
            os.replace(local, dst)
        except OSError:
            if not (dst / "config.json").is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # another process may have filled dst first
        return dst

    def prune_cache(self) -> list[Path]:
        """Removes downloaded versions (<cache_dir>/<model>/v<N>, v<N>-<run id>.gguf) beyond the
        `keep_cached` newest, so a long-running service's disk does not grow with every
        promotion. Never one an alias names (champion, previous, trainee: what serving, a
        rollback and the next round read), nor anything changed in the last PRUNE_GRACE_S (a
        process sharing the cache may be loading it); downloads a killed process left half-way
        go once past that grace. Reads the aliases first: nothing is removed when they cannot
        be read. Returns what it removed."""
        root = self.settings.cache_dir / self.name
        if self.settings.keep_cached <= 0 or not root.is_dir():
            return []
        named = {int(v) for v in (self._aliases() or {}).values() if str(v).isdigit()}
        cached: dict[int, list[Path]] = {}
        partial = []
        for entry in root.iterdir():
            stem = entry.name.removesuffix(".gguf").split("-", 1)[0]  # v<N>-<run id>.gguf (v<N>.gguf: older)
            if stem.startswith("v") and stem[1:].isdigit():
                cached.setdefault(int(stem[1:]), []).append(entry)
            elif entry.name.startswith(".v"):
                partial.append(entry)
        newest = sorted(cached, reverse=True)[: self.settings.keep_cached]
        stale = [e for v, entries in cached.items() if v not in named and v not in newest for e in entries] + partial
        removed = []
        for entry in stale:
            try:
                if time.time() - entry.stat().st_mtime < PRUNE_GRACE_S:
                    continue
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            except FileNotFoundError:  # another process pruned it first
                continue
            removed.append(entry)
        if removed:
            log.info("registry: removed %d cached download(s) of %s: %s", len(removed), self.name,
                     ", ".join(e.name for e in sorted(removed)))
        return removed

    def log_round(self, result: RoundResult, *, target_model: str = "", promote: bool | None = None) -> LoggedRound:
        """Logs `result` as a run, registers its candidate as a new version, and promotes it when
        `promote` (default: the gate's `result.promoted`). Returns the run id and version."""
        promote = result.promoted if promote is None else promote
        run = self._start_run(f"round-{result.candidate_version}",
                              {"livedraft.kind": "round", "promoted": str(result.promoted), "reason": result.reason})
        try:
            run_id = run.info.run_id
            self._log_round_data(run_id, result, target_model)
            version = self._register(run, _version_tags(result, target_model))
        except BaseException:
            self.client.set_terminated(run.info.run_id, "FAILED")
            raise
        self.client.set_terminated(run_id)
        if promote:
            self.promote(version)
        log.info("registry: round %s logged as run %s, version %d (%s)", result.candidate_version, run_id,
                 version, "champion" if promote else "not promoted")
        return LoggedRound(run_id, version, promote)

    def promote(self, version: int) -> None:
        """Moves `champion` to `version`; the old champion becomes `previous`, unless it was rolled
        back (a rollback report that came late): `previous` then stays, so a later rollback never
        returns to a version the runtime already left. Raises RegistryError for an unknown version."""
        from mlflow.exceptions import MlflowException

        current = self.champion_version()
        if current == version:
            return
        try:
            self.client.get_model_version(self.name, str(version))
        except MlflowException as e:
            raise RegistryError(f"{self.name} has no version {version}: pick one from history()") from e
        if current is not None and not self._rolled_back(current):
            self.client.set_registered_model_alias(self.name, PREVIOUS, str(current))
        self.client.set_registered_model_alias(self.name, CHAMPION, str(version))
        self.set_trainee(None)  # a new champion starts the lineage again (a round's trainer sets it after)
        self.client.set_model_version_tag(self.name, str(version), "promoted_at", _now())
        log.info("registry: %s version %d is champion (previous %s)", self.name, version, current)

    def tag_rolled_back(self, version: int, numbers: dict[str, float], *, reason: str = "") -> int | None:
        """Tags `version` as rolled back (with `numbers`, e.g. acceptance before/after the swap) and, if it
        is the champion, moves `champion` back to `previous`. Returns the champion after the call, or
        None when there is none; a champion without a `previous` stays in place (logged)."""
        v = str(version)
        self.client.set_model_version_tag(self.name, v, "rolled_back", "true")
        self.client.set_model_version_tag(self.name, v, "rolled_back_at", _now())
        if reason:
            self.client.set_model_version_tag(self.name, v, "rollback.reason", reason)
        for key, value in numbers.items():
            self.client.set_model_version_tag(self.name, v, f"rollback.{key}", str(value))
        champion, previous = self.champion_version(), self._alias(PREVIOUS)
        if champion != version:
            return champion
        if previous is None or self._rolled_back(previous):
            log.warning("registry: version %d rolled back but has no %r version to return to%s; it stays champion",
                        version, PREVIOUS, "" if previous is None else f" (version {previous} was rolled back too)")
            return champion
        self.set_trainee(None)  # the lineage grew from the version rolled back: start again from the champion
        self.client.set_registered_model_alias(self.name, CHAMPION, str(previous))
        self.client.delete_registered_model_alias(self.name, PREVIOUS)
        log.warning("registry: rolled %s back from version %d to %d", self.name, version, previous)
        return previous

    def _rolled_back(self, version: int) -> bool:
        return self.client.get_model_version(self.name, str(version)).tags.get("rolled_back") == "true"

    def history(self) -> list[VersionInfo]:
        """All versions, newest first, with their aliases and tags; [] before bootstrap."""
        aliases = self._aliases()
        if aliases is None:
            return []
        by_version: dict[int, list[str]] = {}
        for alias, v in aliases.items():
            by_version.setdefault(int(v), []).append(alias)
        versions = self.client.search_model_versions(f"name='{self.name}'")
        out = [VersionInfo(int(mv.version), sorted(by_version.get(int(mv.version), [])), dict(mv.tags),
                           mv.run_id, mv.source, mv.creation_timestamp / 1000.0) for mv in versions]
        return sorted(out, key=lambda x: -x.version)

    def _start_run(self, run_name: str, tags: dict[str, str]) -> Any:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.settings.experiment)
        if exp is None:
            location = f"{self.settings.artifact_root.rstrip('/')}/{self.settings.experiment}"
            try:
                exp_id = self.client.create_experiment(self.settings.experiment, artifact_location=location)
            except MlflowException:  # created concurrently by another process
                exp_id = self.client.get_experiment_by_name(self.settings.experiment).experiment_id
        else:
            exp_id = exp.experiment_id
        return self.client.create_run(exp_id, run_name=run_name, tags=tags)

    def _register(self, run: Any, tags: dict[str, str]) -> int:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            self.client.create_registered_model(self.name, description="livedraft drafters; alias champion serves")
        source = f"{run.info.artifact_uri}/{DRAFTER_ARTIFACTS}"
        mv = self.client.create_model_version(self.name, source=source, run_id=run.info.run_id,
                                              tags={k: v for k, v in tags.items() if v != ""})
        return int(mv.version)

    def _log_round_data(self, run_id: str, result: RoundResult, target_model: str) -> None:
        from mlflow.entities import Metric, Param

        params = _round_params(result, target_model)
        self.client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
        metrics = [Metric(k, v, int(time.time() * 1000), step) for k, v, step in _round_metrics(result)]
        for i in range(0, len(metrics), 1000):  # MLflow's per-batch limit
            self.client.log_batch(run_id, metrics=metrics[i : i + 1000])
        self._log_drafter(run_id, result.candidate_dir, target_model)
        with tempfile.TemporaryDirectory() as tmp:
            from online.registry.plots import replay_plot

            plot = replay_plot(result, Path(tmp) / "replay_acceptance.png")
            summary = Path(tmp) / "round.json"
            summary.write_text(json.dumps(dataclasses.asdict(result), default=str, indent=1))
            self.client.log_artifact(run_id, str(plot), "plots")
            self.client.log_artifact(run_id, str(summary))

    def _log_drafter(self, run_id: str, drafter_dir: Path, target_model: str = "") -> None:
        """The drafter directory as the run's artifact (what versions point at); an eagle head
        also as its speculators export, which vLLM's --speculative-config loads, and as its GGUF,
        which llama-server loads, when its target resolves."""
        from runtime.drafters.eagle import export_speculators, is_eagle_dir

        with tempfile.TemporaryDirectory() as tmp:
            logged = drafter_dir
            if (drafter_dir / OPTIMIZER_STATE).exists():  # the lineage's optimizer: the trainer's, not the version's
                logged = Path(tmp) / "drafter"
                shutil.copytree(drafter_dir, logged, ignore=shutil.ignore_patterns(OPTIMIZER_STATE))
            self.client.log_artifacts(run_id, str(logged), DRAFTER_ARTIFACTS)
        if is_eagle_dir(drafter_dir):
            with tempfile.TemporaryDirectory() as tmp:
                self.client.log_artifacts(run_id, str(export_speculators(drafter_dir, Path(tmp) / "x")),
                                          SPECULATORS_ARTIFACTS)
                head = _gguf_head(drafter_dir, target_model, Path(tmp) / Path(GGUF_ARTIFACT).name)
                if head is not None:
                    self.client.log_artifact(run_id, str(head), str(Path(GGUF_ARTIFACT).parent))

    def gguf(self, version: int) -> Path:
        """The GGUF head of `version` (what `llama-server -md` loads), from the cache or downloaded
        (atomically) into it. Cached as v<N>-<run id>.gguf, so a registry started again (versions
        numbered from 1 again) is never served the old registry's head, as in `download`. Raises
        RegistryError for an unknown version or one without a GGUF head."""
        from mlflow.exceptions import MlflowException

        run_id = self._run_id(version)
        dst = self.settings.cache_dir / self.name / f"v{version}-{run_id}.gguf"
        if dst.is_file():
            return dst
        import mlflow.artifacts

        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-gguf-", dir=dst.parent))
        try:
            local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=GGUF_ARTIFACT, dst_path=str(tmp),
                                                        tracking_uri=self.settings.tracking_uri)
            os.replace(local, dst)
        except (MlflowException, OSError) as e:
            if not dst.is_file():
                raise RegistryError(f"{self.name} version {version} has no GGUF head ({GGUF_ARTIFACT}: {e}); "
                                    "its target did not resolve when it was registered: export it with "
                                    "`livedraft drafter export DIR --format gguf --target TARGET`") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dst

    def _run_id(self, version: int) -> str:
        """The MLflow run `version` was registered from (what its cached downloads are keyed by);
        RegistryError for a version the registry does not have."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version(self.name, str(version)).run_id or ""
        except MlflowException:
            raise RegistryError(f"registered model {self.name!r} has no version {version}") from None

    def _alias(self, alias: str) -> int | None:
        v = (self._aliases() or {}).get(alias)
        return int(v) if v is not None else None

    def _aliases(self) -> dict[str, str] | None:
        """Alias -> version of the registered model; None when the model does not exist yet."""
        from mlflow.exceptions import MlflowException

        try:
            return dict(self.client.get_registered_model(self.name).aliases)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise


def _run_marker(drafter_dir: Path) -> str | None:
    try:
        return (drafter_dir / RUN_MARKER).read_text()
    except OSError:
        return None


def _gguf_head(drafter_dir: Path, target_model: str, out: Path) -> Path | None:
    """The eagle head as a GGUF for `target_model` (default: the verifier its config names), or
    None with a warning: a version without a GGUF still serves in livedraft's engine and vLLM."""
    from runtime.drafters.eagle_gguf import export_gguf

    try:
        return export_gguf(drafter_dir, out, target=target_model or None)
    except LivedraftError as e:
        log.warning("registry: %s gets no GGUF head (llama-server cannot load it): %s", drafter_dir, e)
    except Exception:  # a failed export must never fail a registration
        log.exception("registry: exporting %s as a GGUF head failed; registering it without one", drafter_dir)
    return None


def _version_tags(result: RoundResult, target_model: str) -> dict[str, str]:
    from runtime.drafters.factory import drafter_kind

    return {
        "kind": "round", "parent_version": result.parent_version or result.champion_version,
        "champion_version": result.champion_version, "drafter_version": result.candidate_version,
        "drafter_kind": drafter_kind(result.candidate_dir),
        "target_model": target_model, "loss": result.config.loss, "data_window": json.dumps(result.window),
        "promoted": str(result.promoted).lower(), "reason": result.reason,
        "candidate_mean_acceptance_length": f"{result.candidate.mean_acceptance_length:.4f}",
        "candidate_acceptance_rate": f"{result.candidate.acceptance_rate:.4f}",
        "champion_mean_acceptance_length": f"{result.champion.mean_acceptance_length:.4f}",
        "champion_acceptance_rate": f"{result.champion.acceptance_rate:.4f}",
    }


def _round_params(result: RoundResult, target_model: str) -> dict[str, str]:
    cfg = result.config
    keys = ["loss", "lr", "steps", "max_seconds", "batch_size", "ce_weight", "seed", "lora", "promote_margin",
            "replay_k", "lineage"]
    keys += ["jsd_beta"] if cfg.loss == "jsd" else []
    keys += ["lora_r", "lora_alpha", "lora_target_modules"] if cfg.lora else []
    params = {k: str(getattr(cfg, k)) for k in keys}
    params.update({f"window_{k}": str(v) for k, v in result.window.items() if v is not None})
    params.update(base_version=result.parent_version or result.champion_version,
                  champion_version=result.champion_version, candidate_version=result.candidate_version)
    if target_model:
        params["target_model"] = target_model
    return params


def _round_metrics(result: RoundResult) -> list[tuple[str, float, int]]:
    t = result.training
    out = [(name, v, i) for name, vs in (("train_loss", t.losses), ("train_kd_loss", t.kd_losses),
                                           ("train_ce_loss", t.ce_losses)) for i, v in enumerate(vs)]
    for who, m in (("candidate", result.candidate), ("champion", result.champion)):
        out += [(f"{who}_mean_acceptance_length", m.mean_acceptance_length, 0),
                (f"{who}_acceptance_rate", m.acceptance_rate, 0)]
        out += [(f"{who}_acceptance_per_position", v, i + 1) for i, v in enumerate(m.per_position_acceptance)]
    gain = result.candidate.mean_acceptance_length - result.champion.mean_acceptance_length
    out += [("gain_mean_acceptance_length", gain, 0), ("train_seconds", t.seconds, 0),
            ("train_steps_per_s", t.steps_per_s, 0), ("round_seconds", result.seconds, 0)]
    return out


def _as_uri(location: str) -> str:
    if "://" in location or location.startswith("file:"):
        return location
    return Path(location).expanduser().resolve().as_uri()


def ensure_sqlite_dir(uri: str) -> None:
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

