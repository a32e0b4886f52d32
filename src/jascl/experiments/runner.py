"""Runs a protocol for several methods into one run folder and collects the results.

Run folder layout::

    <out>/run.json             what was run (protocol source, seed, methods, data options): ``--resume`` reads it
    <out>/config.yaml          resolved run configuration
    <out>/protocol.yaml        the protocol file the run started from (a copy)
    <out>/protocol-resolved.json  the protocol as run (seed and variants applied; see jascl.protocols.resolved)
    <out>/manifest.json        K-shot manifest: sample ids of every split, per session
    <out>/environment.json     versions of jascl, torch, monai, numpy, python, CUDA/cuDNN, device count
    <out>/tensorboard/<method>/  TensorBoard scalars (with ``tensorboard: true``)
    <out>/log.txt              log
    <out>/base/                session 0 shared by every method that does not change it
    <out>/base-<key>/          session 0 shared by a family that changes it alike (e.g. base-stochastic-classifier:
                               the JASCL presets; see Plugin.base_key)
    <out>/<method>/options.json  the method's resolved options: a later run into the folder must match them
    <out>/<method>/s<t>-<name>/  model.safetensors, prototypes.safetensors, metrics.json
                               (progress.safetensors while the session trains)
    <out>/results.{json,csv,md}

A session whose ``metrics.json`` exists is complete: rerunning with the same
``--out`` (or ``jascl run --resume <out>``) reuses it instead of training
again; a session with a ``progress.safetensors`` continues after its last
checkpointed epoch. Every file is written atomically (temporary file +
rename), so a run killed at any point leaves a folder that resumes to exactly
the results of an uninterrupted run. With several processes only rank 0 writes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from jascl import distributed
from jascl.data.sessions import apply_unlabelled_noise, check_same_samples, load_sessions, write_manifest
from jascl.data.types import SessionData
from jascl.engine.config import RunConfig, translate_legacy
from jascl.engine.console import EpochLines, interactive
from jascl.engine.loop import ContinualTrainer
from jascl.engine.plugin import Method, Plugin
from jascl.engine.prototypes import PrototypeStore
from jascl.engine.stop import REQUEST
from jascl.errors import ConfigError, JasclError
from jascl.evaluation.metrics import per_class_forgetting, total_drop
from jascl.experiments.bases import VANILLA, base_folders, ensure_base, missing_bases, restorers, train_bases
from jascl.experiments.preflight import RunFolder, preflight
from jascl.experiments.provenance import environment
from jascl.fileio import atomic_write_text
from jascl.methods.presets import jascl_options
from jascl.methods.registry import check_method_args, create_method, resolved_options
from jascl.protocols.resolved import protocol_from_json, protocol_to_json
from jascl.protocols.schema import Protocol, SessionSpec
from jascl.results.report import write_all

log = logging.getLogger("jascl")

#: what :func:`run_benchmark` does: everything, or a launcher's share of it
STAGES = ("all", "files", "bases", "cell")


def _method_summary(protocol: Protocol, records: list[dict]) -> dict:
    scores = [r["all"] for r in records]
    try:
        drop = total_drop(scores) if scores and scores[0] and not math.isnan(scores[0]) else math.nan
    except ValueError:
        drop = math.nan
    history: dict[int, list[float]] = {}
    for r in records:
        for key, value in r["per_class"].items():
            if key != "0":
                history.setdefault(int(key), []).append(value)
    forgetting = per_class_forgetting(history)
    # wall-clock time stays in each session's metrics.json: results depend on nothing but the run's inputs
    sessions = [{k: v for k, v in r.items() if k != "seconds"} for r in records]
    return {"sessions": sessions, "total_drop": drop, "forgetting": {str(k): v for k, v in forgetting.items()}}


def _setup_logging(out: Path) -> logging.Handler:
    if not distributed.is_main():
        return logging.NullHandler()
    handler = logging.FileHandler(out / "log.txt")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler


#: configuration keys that may differ between a run folder's runs without changing results
_NEUTRAL_KEYS = (
    "device",
    "threads",
    "method_args",
    "tensorboard",
    "num_workers",
    "prepare_workers",
    "pin_memory",
    "checkpoint_every",
    "checkpoint_steps",
)


def check_reusable(out: Path, config: RunConfig, protocol: Protocol) -> None:
    """Refuse to add to a run folder whose finished sessions came from another configuration or protocol.

    Reusing a session trained under other settings would silently mix results.
    ``device`` and ``threads`` may differ; the baselines' ``method_args`` may too here (they only
    concern the methods they name; :func:`check_method_options` refuses to reuse a method's own
    sessions trained with other options), but not JASCL's (``method_args.jascl``, the settings of the method under study, compared as
    resolved options). A key the folder's configuration lacks (added to jascl later) matches
    its default value; a folder written before JASCL's options moved to ``method_args.jascl``
    is read with them there.
    """
    previous = out / "config.yaml"
    if previous.exists():
        old = translate_legacy(yaml.safe_load(previous.read_text()) or {})
        new = config.to_dict()
        default = RunConfig().to_dict()
        changed = sorted(
            k for k in set(old) | set(new) if k not in _NEUTRAL_KEYS and old.get(k, default.get(k)) != new.get(k)
        )
        before = _flat(dataclasses.asdict(jascl_options(RunConfig(method_args=old.get("method_args") or {}))))
        after = _flat(dataclasses.asdict(jascl_options(config)))
        changed += sorted(f"method_args.jascl.{k}" for k in before if before[k] != after[k])
        if changed:
            raise ConfigError(
                f"{out}: this run folder was made with a different configuration ({', '.join(changed)}); "
                "use a new --out, or rerun with the same settings to resume"
            )
    resolved = out / "protocol-resolved.json"
    if resolved.exists():
        old_p = json.loads(resolved.read_text())
        new_p = protocol_to_json(protocol)
        # a session key added to jascl later (e.g. validation) holds its default in a folder written before
        defaults = {f.name: f.default for f in dataclasses.fields(SessionSpec) if f.default is not dataclasses.MISSING}
        for entry in old_p.get("sessions") or []:
            if isinstance(entry, dict):
                for key, value in json.loads(json.dumps(defaults, default=list)).items():
                    entry.setdefault(key, value)
        # label maps are [native, global] pairs now; a folder written before has objects with string keys
        datasets = old_p.get("datasets") or {}
        if any(isinstance(e, dict) and isinstance(e.get("labels"), dict) for e in datasets.values()):
            pairs = protocol_to_json(protocol_from_json(old_p))["datasets"]
            for name, entry in datasets.items():
                entry["labels"] = pairs[name]["labels"]
        changed = sorted(
            k
            for k in set(old_p) | set(new_p)
            if k not in ("path", "file", "session0_of") and old_p.get(k) != new_p.get(k)
        )
        if changed:
            raise ConfigError(
                f"{out}: this run folder was made with a different protocol ({', '.join(changed)}); use a new --out"
            )


#: a method's resolved options, written in its folder when it first trains there
OPTIONS_FILE = "options.json"


def check_method_options(folder: Path, name: str, config: RunConfig) -> None:
    """Refuse to reuse ``folder`` (one method's sessions in a run folder) if they were trained with other options.

    The method's resolved options (defaults updated from ``method_args``) are kept in
    ``folder/options.json``; on a later run into the same folder they must be equal, so that a compare
    folder never silently mixes sessions trained with ``--set method_args.<m>.x=1`` and without it. An
    option the file lacks (added to the method later, at any depth: ``gas.variant``) matches its default
    value. A folder that has no file yet (written before jascl kept one), or no finished session (its
    file was written when a run started and stopped before training the method), gets the current
    options. Methods the
    registry does not know (an ablation built from a preset) are not checked here; their settings are in
    ``method_args.jascl``, which :func:`check_reusable` compares.

    Raises:
        ConfigError: ``<folder>: its sessions were trained with method_args.<key>.<option>=<old> (now <new>) ...``.
    """
    from jascl.methods.registry import METHODS

    now = resolved_options(name, config)
    if now is None:
        return
    path = folder / OPTIONS_FILE
    if path.exists():
        before = _flat(json.loads(path.read_text()))
        defaults = _flat(resolved_options(name, RunConfig()) or {})
        flat_now = _flat(now)
        key = METHODS.info(name).options_key  # "" for a composed method: its options are keyed by part
        prefix = f"method_args.{key}." if key else "method_args."
        changed = [
            f"{prefix}{k}={before.get(k, defaults.get(k))!r} (now {flat_now[k]!r})"
            for k in sorted(flat_now)
            if before.get(k, defaults.get(k)) != flat_now[k]
        ]
        trained = any(folder.glob("s*/metrics.json")) or any(folder.glob("s*/progress.safetensors"))
        if changed and trained:
            raise ConfigError(
                f"{folder}: its sessions were trained with {', '.join(changed)}; use a new --out, set the "
                f"options back to resume, or delete {folder} to retrain {name}"
            )
        if (changed or set(flat_now) - set(before)) and distributed.is_main():
            atomic_write_text(path, json.dumps(now, indent=2, sort_keys=True) + "\n")
    elif distributed.is_main():
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(now, indent=2, sort_keys=True) + "\n")


def _flat(tree: Mapping, prefix: str = "") -> dict:
    """A nested mapping as ``{"a.b": value}``."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def write_run_files(
    out: Path,
    protocol: Protocol,
    config: RunConfig,
    methods: Sequence[str],
    data: Sequence[SessionData],
    cache_dir,
    roots,
    roots_file,
    split_manifest,
    imports: Sequence[str] = (),
) -> None:
    """The run folder's description of itself (atomic writes): configuration, protocol, manifest, environment,
    and ``run.json``, from which ``jascl run --resume`` restarts the run with nothing else given."""
    atomic_write_text(out / "config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False))
    if protocol.file is not None and Path(protocol.file).is_file():
        atomic_write_text(out / "protocol.yaml", Path(protocol.file).read_text())
    # label maps as [native, global] pairs: a JSON object would make native ids names (jascl.protocols.resolved)
    atomic_write_text(out / "protocol-resolved.json", json.dumps(protocol_to_json(protocol), indent=1))
    resolved_roots = None
    if protocol.uses_datasets and data is not None:
        from jascl.data.real import resolve_roots

        try:
            resolved_roots = resolve_roots(protocol, roots, roots_file)
        except JasclError:  # data passed in directly: the roots are provenance only
            resolved_roots = None
    write_manifest(protocol, data, out / "manifest.json", resolved_roots)
    atomic_write_text(out / "environment.json", json.dumps(environment(), indent=1))
    record = {
        "protocol": protocol.name,
        "protocol_file": "protocol.yaml" if (out / "protocol.yaml").exists() else None,
        "seed": protocol.seed,
        "methods": list(methods),
        "cache_dir": str(Path(cache_dir).resolve()) if cache_dir is not None else None,
        "roots": {k: str(Path(v).resolve()) for k, v in (roots or {}).items()},
        "roots_file": str(Path(roots_file).resolve()) if roots_file is not None else None,
        # every root's folder, however it was given (--root, roots file, JASCL_ROOT_<NAME>): what jascl report reads
        "resolved_roots": {k: str(Path(v).resolve()) for k, v in (resolved_roots or {}).items()},
        "split_manifest": str(Path(split_manifest).resolve()) if split_manifest is not None else None,
        "imports": list(imports),
    }
    atomic_write_text(out / "run.json", json.dumps(record, indent=1))


def read_run_file(out: str | Path) -> dict:
    """``run.json`` of a run folder (for ``--resume``), with a one-line error if the folder is not a run."""
    path = Path(out) / "run.json"
    if not path.is_file():
        raise ConfigError(
            f"{out}: not a jascl run folder (no run.json); give the --out folder of an earlier "
            "'jascl run' (a folder written before run folders kept run.json resumes by rerunning its command "
            "with --out)"
        )
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: unreadable ({exc}); rerun the original command with --out {out}") from None
    for key in ("protocol", "seed", "methods"):
        if key not in record:
            raise ConfigError(f"{path}: missing {key!r}; rerun the original command with --out {out}")
    return record


def run_benchmark(
    protocol: Protocol,
    config: RunConfig,
    methods: Sequence[str | Method],
    out: str | Path,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    echo=print,
    data: Sequence[SessionData] | None = None,
    roots: Mapping[str, str | Path] | None = None,
    split_manifest: str | Path | None = None,
    roots_file: str | Path | None = None,
    extra_plugins: Sequence[Plugin | Callable[[], Plugin]] = (),
    imports: Sequence[str] = (),
    stage: str = "all",
    bases: Sequence[str] | None = None,
) -> dict:
    """Run ``methods`` on ``protocol`` and write the run folder; returns the results dict.

    Args:
        methods: registered method names (``jascl methods``; register your own with
            ``@METHODS.register(name)`` from :mod:`jascl.methods`), or :class:`Method` objects
            built by hand (their names name the run-folder entries).
        extra_plugins: plugins added after every method's own (logging, probes, your own
            instrumentation): a :class:`Plugin` instance is shared by every method, a callable
            (e.g. the plugin class) is called once per method for a fresh one. They do not change
            which base model a method shares.
        data: one :class:`SessionData` per session, for your own arrays; by default
            the protocol's data is loaded by :func:`jascl.data.sessions.load_sessions` (synthetic: generated and
            cached in ``cache_dir``; on datasets: assembled from the local copies).
        roots, roots_file: dataset root folders by name (protocols on datasets; see
            :func:`jascl.data.real.resolve_roots`).
        split_manifest: a ``manifest.json`` whose samples are reused instead of a new selection.
        imports: the modules that registered your own methods or backbones (``jascl run --import``), recorded
            in ``run.json`` so that ``jascl run --resume`` imports them again.
        stage: ``"all"`` (default); ``"files"``: write the run files and return ``{"bases": {folder: [methods]}}``,
            the shared session-0 bases not yet complete (:func:`jascl.experiments.bases.missing_bases`: what a
            launcher does before it fans the work out); ``"bases"``: train the shared bases named in ``bases``
            (None: all) into a folder ``"files"`` prepared, then return ``{}`` (a launcher's base job);
            ``"cell"``: train the methods' sessions into a folder whose bases are complete. ``"bases"`` and
            ``"cell"`` write neither the run files nor the results and do not hold the folder's lock (a
            launcher's jobs, beside others in the same folder; a final ``"all"`` pass collects them).
        bases: with ``stage="bases"``, the shared bases to train (``base``, ``base-<key>``).
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)} (got {stage!r})")
    if not methods:
        raise ConfigError("--methods: give at least one method (see 'jascl methods')")
    check_method_args(config)
    built: list[Method] = [m if isinstance(m, Method) else create_method(m, config, protocol.task) for m in methods]
    methods = [m.name for m in built]
    if len(set(methods)) != len(methods):
        raise ConfigError(f"--methods: a method is listed twice ({','.join(methods)})")
    out = Path(out)
    main = distributed.is_main()
    files = stage in ("all", "files")  # a launcher's jobs share the folder the "files" stage prepared
    hold = main and files
    if hold:
        preflight(out, protocol, config)
    run_folder = RunFolder(out, hold)
    run_folder.open()  # locked before anything is written into it (log.txt included)
    extras = list(extra_plugins)
    if config.tensorboard and main:  # live scalars; last plugin, so it sees every loss term and statistic
        from jascl.results.tensorboard import TensorBoardPlugin

        extras.append(lambda: TensorBoardPlugin(out))
    bars = progress and main and interactive()  # a log file gets lines, not carriage-return redraws
    shown = [EpochLines(echo, bars)] if progress and main else []  # one line per epoch, a step bar in a terminal
    extras += shown
    progress = bars
    if main:
        out.mkdir(parents=True, exist_ok=True)
    handler = _setup_logging(out)
    started = False
    try:
        if protocol.uses_datasets and protocol.task == "segmentation" and config.patch_size is None:
            raise ConfigError(
                f"{protocol.path}: patch_size is null; protocols on datasets train on patches and "
                "evaluate with a sliding window of that size: set training.patch_size or "
                "--set patch_size=[...]"
            )
        if data is None:
            with distributed.main_first():  # rank 0 generates and caches, the others read the cache
                data = load_sessions(
                    protocol,
                    cache_dir,
                    echo,
                    roots,
                    split_manifest,
                    roots_file,
                    config.patch_size,
                    config.prepare_workers,
                    progress=progress,  # --no-progress and log files: no bar for the store's fill either
                    stop=lambda: REQUEST.requested,  # Ctrl-C / SIGTERM while it fills the store: the loop then stops
                )
        elif len(data) != len(protocol.sessions):
            raise ConfigError(f"{protocol.path}: {len(protocol.sessions)} sessions but data for {len(data)} were given")
        else:
            data = apply_unlabelled_noise(protocol, data)
        check_same_samples(protocol, data)
        check_reusable(out, config, protocol)
        if main and files:
            write_run_files(out, protocol, config, methods, data, cache_dir, roots, roots_file, split_manifest, imports)
        started = True  # from here a failure is written into the folder's log; before, the folder is left as it was
        log.info("run %s: protocol %s seed %d methods %s", out, protocol.name, protocol.seed, ",".join(methods))

        shared_base = None
        results = {
            "protocol": protocol.name,
            "metric": protocol.metric,
            "eval_mode": config.eval_mode,
            "background": (
                "included in means (the authors' code's convention)"
                if config.background_in_mean
                else "excluded from means"
            ),
            "seed": protocol.seed,
            "classes": {str(c.id): c.name for c in protocol.classes},
            "methods": {},
        }
        for method in built if stage != "bases" else []:  # every method's folder is checked before anything trains
            check_method_options(out / method.name, method.name, config)  # (a base job trains none of them)
        if stage == "files":
            return {"bases": missing_bases(out, built)}
        if stage == "bases":  # a launcher's base job
            train_bases(protocol, config, data, out, built, bases, progress, echo, shown)
            return {}
        bar = tqdm(
            total=len(built) * len(protocol.sessions), desc="sessions", unit="session", disable=not (progress and main)
        )
        for method in built:
            plugins = [p if isinstance(p, Plugin) else p() for p in extras]
            trainer = ContinualTrainer(protocol, config, method, data, progress=progress, extra_plugins=plugins)
            records: list[dict] = []
            start = 0
            if not method.changes_base_session:
                base_dir = out / "base"
                if shared_base is None:
                    sharers = restorers(base_folders(built)[VANILLA])
                    ensure_base(protocol, config, data, base_dir, progress, echo, plugins=shown, anticipate=sharers)
                    shared_base = base_dir
                model, store, record = trainer.load_session(shared_base, 0)
                trainer.restore_session(0, shared_base, model, store)
                records.append(record)
                bar.update(1)
                start = 1
            elif method.base_key is not None:  # a base shared with the methods of the same key
                keyed = out / f"base-{method.base_key}"
                sharers = restorers(base_folders(built)[keyed.name])
                ensure_base(protocol, config, data, keyed, progress, echo, method.base_method(), shown, sharers)
                model, store, record = trainer.load_session(keyed, 0)
                trainer.restore_session(0, keyed, model, store)
                records.append(record)
                bar.update(1)
                start = 1
            else:
                model, store = trainer.initial_model(len(protocol.seen_classes(0))), PrototypeStore()
            for t in range(start, len(protocol.sessions)):
                session = protocol.sessions[t]
                folder = out / method.name / f"s{t}-{session.name}"
                if distributed.broadcast_object((folder / "metrics.json").exists()):
                    model, store, record = trainer.load_session(folder, t)
                    trainer.restore_session(t, folder, model, store)
                    echo(f"[{method.name}] session {t} ({session.name}): reusing {folder}")
                else:
                    echo(f"[{method.name}] session {t} ({session.name}): training")
                    record = trainer.run_session(t, model, store, folder)
                log.info(
                    "%s session %d %s: all=%.4f old=%.4f new=%.4f base=%.4f",
                    method.name,
                    t,
                    session.name,
                    record["all"],
                    record["old"],
                    record["new"],
                    record["base"],
                )
                records.append(record)
                bar.update(1)
            results["methods"][method.name] = _method_summary(protocol, records)
        bar.close()
        if main and stage == "all":
            write_all(results, out)
        return results
    except BaseException as exc:  # the folder's log says why the run stopped (input refused earlier: untouched)
        if started:
            log.error("stopped: %s", (str(exc).splitlines() or [type(exc).__name__])[0])
        raise
    finally:
        log.removeHandler(handler)
        handler.close()
        run_folder.close(failed=sys.exc_info()[0] is not None)
