"""``jascl study components``: JASCL and its component ablations from the same base model, over seeds.

The study runs the full method and one ablation per component -- w/o GAS, w/o prototype replay,
w/o PAS, w/o unlabelled data (the registered presets ``jascl``, ``jascl-no-gas``, ``jascl-no-replay``,
``jascl-conf``, ``jascl-no-unlabelled``) -- on one protocol for several seeds, through
:func:`jascl.experiments.compare.run_compare`: per seed, every variant runs in one run folder, so they
share the data, the K-shot manifest and the session-0 model (the JASCL family's stochastic base,
``seed-<s>/base-stochastic-classifier``, trained once). A variant is paired with the full method seed
by seed; :mod:`jascl.results.study` writes the tables (mean ± 95 % Student t interval, paired
differences) and the Seen / New / HM figure from the run folders.

What is run is decided before anything trains (:func:`plan_study`):

* a variant with no implementation for the protocol's task (detection: ``jascl methods --task
  detection``) is not run, and said so;
* on a protocol whose incremental sessions have no unlabelled pool, w/o PAS and w/o unlabelled are the
  full method (the mean teacher has nothing to train on): not run, and said so;
* "w/o PAS" keeps the mean teacher on the pool and removes PAS's prototype test from eq. 4, so its
  pseudo-labels pass on confidence alone (``jascl-conf``); "w/o unlabelled" removes the teacher and the
  pool altogether (``jascl-no-unlabelled``, the same plugins as the paper-named ``jascl-no-pas``). The
  first measures what the prototype anchoring adds, the second what the unlabelled data adds;
* two variants built from the same plugins with the same settings train once; the second reads the
  first's runs, and the tables say so;
* every variant must start from the same session-0 model; a configuration under which they would not
  (e.g. ``gas.in_base=true``: the full method then trains its own base) is refused, as are
  ``method_args.jascl.components`` switches (the study sets them itself).

Folder layout::

    <out>/study-plan.json      what the study runs (variants, seeds, protocol) and every command that ran it
    <out>/seed-<s>/            one run folder per seed (jascl.experiments.runner), shared by every variant
    <out>/compare.{md,csv,json}  mean ± std per method (jascl compare's table of the same runs)
    <out>/study.{md,json}, variants.csv, differences.csv, seen-new-hm.{png,csv}, compute.csv
                               the study's tables and figure (jascl.results.study)

Rerunning the same command continues a killed study: finished sessions are reused, an interrupted one
continues from its last checkpoint. ``--report`` re-renders the tables from the folder alone.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jascl.engine.config import RunConfig
from jascl.engine.plugin import Method
from jascl.errors import ConfigError
from jascl.experiments.launcher import Launcher
from jascl.fileio import atomic_write_text
from jascl.protocols.schema import Protocol
from jascl.results.study import PLAN_FILE, read_plan, write_study


@dataclass(frozen=True)
class Variant:
    """One row of the component study.

    Attributes:
        component: the component the variant removes (``"full"`` for the full method).
        label: the row's name in the tables.
        method: the registered method that implements it.
    """

    component: str
    label: str
    method: str


#: the study's variants, in table order
VARIANTS: tuple[Variant, ...] = (
    Variant("full", "full JASCL", "jascl"),
    Variant("gas", "w/o GAS", "jascl-no-gas"),
    Variant("replay", "w/o replay", "jascl-no-replay"),
    Variant("pas", "w/o PAS (confidence-only teacher)", "jascl-conf"),
    Variant("unlabelled", "w/o unlabelled", "jascl-no-unlabelled"),
)

#: components whose ablation equals the full method when no incremental session has an unlabelled pool
POOL_COMPONENTS = ("pas", "unlabelled")


def parse_components(spec: str | None) -> list[str]:
    """``--components gas,replay`` -> the components to ablate (default: all); the full method always runs.

    Raises:
        ConfigError: an unknown component, naming the choices.
    """
    names = [v.component for v in VARIANTS if v.component != "full"]
    if spec is None or spec.strip() in ("", "all"):
        return names
    chosen = [c.strip() for c in spec.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in names]
    if unknown or not chosen:
        raise ConfigError(f"--components {spec}: choose any of {', '.join(names)} (comma-separated), or all")
    return [c for c in names if c in chosen]


_SIMPLE = (type(None), bool, int, float, str)


def _signature(method: Method) -> tuple | None:
    """What a method is made of: its plugins' types and settings, or None if a setting is not plain data.

    Two methods with equal signatures train identically (same plugins, same options, same seed), so
    only one needs to run. None (never equal) where an attribute is anything but a number, string, None
    or an empty container: then the study cannot tell, and runs both.
    """
    parts = []
    for plugin in method.plugins:
        items = []
        for key, value in sorted(vars(plugin).items()):
            if isinstance(value, (dict, list, tuple, set)) and not value:
                value = type(value).__name__
            elif not isinstance(value, _SIMPLE):
                return None
            items.append((key, value))
        parts.append((f"{type(plugin).__module__}.{type(plugin).__qualname__}", tuple(items)))
    return (type(method).__qualname__, tuple(parts))


def _base_of(method: Method) -> str | None:
    """The session-0 model ``method`` starts from: ``"base"`` (shared vanilla), ``"base-<key>"`` (a keyed
    shared base), or None (it trains its own, shared with nobody)."""
    if not method.changes_base_session:
        return "base"
    key = method.base_key
    return f"base-{key}" if key is not None else None


def plan_study(protocol: Protocol, config: RunConfig, components: Sequence[str] | None = None) -> list[dict]:
    """Which variants run, which read another's runs, and which are left out, with the reason.

    Returns:
        One entry per variant in :data:`VARIANTS` order: ``{"component", "label", "method", "status",
        "runs_from", "base", "note"}``; ``status`` is ``"run"``, ``"same"`` (reads the runs of
        ``runs_from``) or ``"skipped"`` (``note`` says why).

    Raises:
        ConfigError: the configuration switches JASCL's components, the full method has no implementation
            for the task, or the variants would not start from the same session-0 model.
    """
    from jascl.methods.presets import jascl_options
    from jascl.methods.registry import METHODS, create_method

    switches = jascl_options(config).components
    off = [k for k in ("gas", "replay", "pas") if not getattr(switches, k)]
    if off:
        raise ConfigError(
            f"method_args.jascl.components.{off[0]}=false: the study switches the components itself; "
            "drop it (and --ablate) from --set / --config"
        )
    wanted = set(parse_components(None) if components is None else components) | {"full"}
    task_methods = set(METHODS.task_methods(protocol.task))
    pools = any(s.has_unlabelled_pool for s in protocol.sessions[1:])
    plan: list[dict] = []
    built: dict[str, Method] = {}
    signatures: dict[tuple, str] = {}
    for v in VARIANTS:
        if v.component not in wanted:
            continue
        entry: dict[str, Any] = {**v.__dict__, "status": "run", "runs_from": v.method, "base": None, "note": ""}
        if v.method not in task_methods:
            if v.component == "full":
                raise ConfigError(f"--protocol {protocol.name}: {v.method} has no {protocol.task} implementation")
            entry.update(
                status="skipped",
                note=f"no {protocol.task} implementation of {v.method} ('jascl methods --task {protocol.task}')",
            )
        elif v.component in POOL_COMPONENTS and not pools:
            entry.update(
                status="skipped",
                note=f"{protocol.name} has no unlabelled pool in any incremental session, so {v.method} trains "
                "exactly as the full method (its mean teacher has nothing to learn from); not run",
            )
        else:
            method = create_method(v.method, config, protocol.task)
            built[v.method] = method
            entry["base"] = _base_of(method)
            sig = _signature(method)
            if sig is not None and sig in signatures:
                same = signatures[sig]
                entry.update(
                    status="same",
                    runs_from=same,
                    note=f"built from the same plugins with the same settings as {same}: its runs are {same}'s",
                )
            elif sig is not None:
                signatures[sig] = v.method
        plan.append(entry)
    bases = {e["method"]: e["base"] for e in plan if e["status"] != "skipped"}
    if None in bases.values() or len(set(bases.values())) > 1:
        described = ", ".join(f"{m}: {b or 'its own'}" for m, b in bases.items())
        raise ConfigError(
            f"the variants would not start from the same session-0 model ({described}); a setting that changes "
            "session 0 for some variants only (e.g. method_args.jascl.gas.in_base=true) cannot be studied this way"
        )
    return plan


def _same_protocol(old: dict, protocol: Protocol) -> None:
    """A study folder holds one protocol (the run folders refuse a changed configuration themselves)."""
    if old.get("protocol") != protocol.name or old.get("task") != protocol.task:
        raise ConfigError(
            f"this study folder holds a study of {old.get('protocol')}; use a new --out for {protocol.name}"
        )


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_study(
    protocol: Protocol,
    config: RunConfig,
    seeds: Sequence[int],
    out: str | Path,
    components: Sequence[str] | None = None,
    command: str = "",
    cache_dir: str | Path | None = None,
    progress: bool = True,
    echo: Callable[[str], None] = print,
    launcher: Launcher | None = None,
    **run_kwargs: Any,
) -> dict:
    """Plan, run (or resume) the component study and write its tables; returns the study summary.

    Args:
        seeds: the seeds (each replaces the protocol's seed: data, K shots and training).
        components: the components to ablate (default all of :data:`VARIANTS`).
        command: the command line that started the study, recorded in ``study-plan.json`` with its wall time.
        launcher, run_kwargs: as :func:`jascl.experiments.compare.run_compare`.
    """
    from jascl.experiments.compare import run_compare
    from jascl.experiments.runner import check_reusable

    out = Path(out)
    variants = plan_study(protocol, config, components)
    old = read_plan(out) if (out / PLAN_FILE).exists() else None
    if old is not None:
        _same_protocol(old, protocol)
    for seed in seeds:  # a changed configuration is refused before the plan is rewritten or anything trains
        check_reusable(out / f"seed-{seed}", config, dataclasses.replace(protocol, seed=seed))
    plan: dict[str, Any] = {
        "study": "components",
        "protocol": protocol.name,
        "task": protocol.task,
        "seeds": list(seeds),
        "variants": variants,
        "commands": list(old.get("commands", [])) if old else [],
    }
    record: dict[str, Any] = {
        "command": command,
        "seeds": list(seeds),
        "started": _now(),
        "seconds": None,
        "finished": False,
    }
    plan["commands"].append(record)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / PLAN_FILE, json.dumps(plan, indent=1) + "\n")
    for entry in variants:
        if entry["status"] != "run":
            echo(f"[study] {entry['label']} ({entry['method']}): {entry['note']}")
    methods = [e["method"] for e in variants if e["status"] == "run"]
    echo(f"[study] running {', '.join(methods)} for seeds {', '.join(map(str, seeds))} into {out}")
    started = time.time()
    try:
        run_compare(
            protocol, config, methods, seeds, out, cache_dir=cache_dir, progress=progress, echo=echo,
            launcher=launcher, **run_kwargs,
        )  # fmt: skip
        record["finished"] = True
    finally:
        record["seconds"] = round(time.time() - started, 1)
        atomic_write_text(out / PLAN_FILE, json.dumps(plan, indent=1) + "\n")
    return write_study(out)
