"""``jascl data check``: does a local copy of the datasets fit a protocol?

For every dataset entry of the protocol it resolves the root, scans the copy with
its layout and opens every sample (``DatasetLayout.check``: missing files,
unreadable or corrupt files, image/label shape and affine mismatches, label values
the dataset does not declare, non-finite or constant images, 4D files where 3D
are expected and the reverse, implausible voxel spacing), reads which labels each
sample contains (a training sample showing only background is a warning: no session uses it), checks the
protocol's label map against the dataset's labels, then runs the session
selection of :mod:`jascl.data.real` as a dry run: every session must find at
least K labelled samples of each class it teaches, test samples of its classes,
and the unlabelled pool it asks for. Each problem is one line naming the file (or
the session / protocol key) and the fix; the summary lists per session its
classes and labelled / unlabelled / test counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jascl.data.check_geometry import held_out_cases, held_out_lines, manifest_plans, planned_shape_report
from jascl.data.real import DatasetSource, SessionPlan, open_source, resolve_roots, session_summary
from jascl.data.synthetic import default_cache_dir
from jascl.errors import DataError
from jascl.protocols.schema import Protocol


@dataclass
class CheckReport:
    """Outcome of :func:`check_protocol`.

    Attributes:
        problems: one line each; any problem makes ``jascl data check`` exit with 2.
        warnings: one line each (e.g. a smaller unlabelled pool than asked for); not fatal.
        datasets: per dataset entry: name, layout, root, sample counts.
        sessions: per session: classes, shots and labelled / unlabelled / test counts.
    """

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    datasets: list[dict] = field(default_factory=list)
    sessions: list[dict] = field(default_factory=list)
    #: dataset -> record ids of the test samples of any session (held out: never trained on)
    held_out: dict[str, list[str]] = field(default_factory=dict)
    #: what the run will do that is worth knowing and no defect (e.g. volumes padded to the patch)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        """The report as printed by ``jascl data check``."""
        out = ["datasets:"]
        for d in self.datasets:
            if d.get("samples") is None:
                out.append(f"  {d['name']} ({d['layout']}): {d['status']}")
                continue
            out.append(
                f"  {d['name']} ({d['layout']}) at {d['root']}: {d['samples']} samples, training pool "
                f"{d['train_pool']}, test pool {d['test_pool']}, without labels {d['label_free']}"
                + (f", {d['excluded']} left out for problems" if d["excluded"] else "")
            )
        out.append("sessions:")
        for s in self.sessions:
            if s.get("skipped"):
                out.append(f"  {s['session']} {s['name']}: not checked ({s['skipped']})")
                continue
            out.append(
                f"  {s['session']} {s['name']} [{', '.join(s['domains'])}]: classes {', '.join(s['classes'])}; "
                f"shots {s['shots']}; labelled {s['labelled']}, unlabelled {s['unlabelled']}, test {s['test']}"
                + (f", validation {s['validation']}" if s.get("validation") else "")
            )
        out += held_out_lines(self.held_out)
        out += [f"note: {n}" for n in self.notes]
        out += [f"warning: {w}" for w in self.warnings]
        out += [f"error: {p}" for p in self.problems]
        out.append(f"{len(self.problems)} problem(s) found" if self.problems else "no problems found")
        return out


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def check_protocol(
    protocol: Protocol,
    roots: Mapping[str, str | Path] | None = None,
    roots_file: str | Path | None = None,
    cache_dir: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    echo: Callable[[str], None] = print,
    patch_size: Sequence[int] | None = None,
    split_manifest: str | Path | None = None,
) -> CheckReport:
    """Check the local dataset copies named by ``roots`` (and the environment) against ``protocol``.

    ``split_manifest``: a run's ``manifest.json`` whose samples are checked instead of a new selection (as
    ``jascl run --split-manifest`` uses them). ``patch_size``: the training patch; volumes smaller after preprocessing are reported as padded
    (:func:`jascl.data.check_geometry.planned_shape_report`, which also refuses a shape that resampling
    collapses or inflates past the voxel limit).

    Raises:
        ConfigError: the protocol is not on datasets, or ``roots`` names a root it does not use.
    """
    if not protocol.uses_datasets:
        from jascl.errors import ConfigError

        raise ConfigError(
            f"{protocol.path}: a synthetic protocol has no dataset copies to check; "
            "give a protocol with a 'datasets' section (jascl protocols)"
        )
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    report = CheckReport()
    problems = report.problems
    resolved = resolve_roots(protocol, roots, roots_file, environ, problems=problems)
    sources: dict[str, DatasetSource] = {}
    for name, spec in protocol.datasets.items():
        entry = {"name": name, "layout": spec.layout, "root": None, "samples": None}
        report.datasets.append(entry)
        if spec.root not in resolved:
            entry["status"] = f"root {spec.root!r} not set"
            continue
        entry["root"] = str(resolved[spec.root])
        src = open_source(protocol, spec, resolved[spec.root], problems)
        if src is None:
            entry["status"] = "could not be opened"
            continue
        report.warnings += getattr(src.layout, "warnings", [])
        for rid, record in src.records.items():
            try:
                found = src.layout.check(record)
            except DataError as exc:  # a layout that raises instead of reporting
                found = [str(exc)]
            if found:
                problems.extend(str(p) for p in found)
                src.excluded.add(rid)
        shape_problems, shape_notes = planned_shape_report({name: src}, patch_size)
        problems += shape_problems
        report.notes += shape_notes
        src.index(cache, echo=echo, problems=problems)
        if src.known is not None:
            for rid in sorted(src.presence):
                outside = sorted(v for v in src.presence[rid] if v not in src.known)
                if outside and rid not in src.excluded:
                    record = src.records[rid]
                    problems.append(
                        f"{record.label}: label value(s) {outside} are outside the label map of dataset {name} "
                        f"(native labels: {', '.join(map(str, sorted(src.known)))}); fix the label file or map the "
                        f"value(s) in datasets.{name}.labels"
                    )
                    src.excluded.add(rid)
        report.warnings += _background_only(name, src)
        entry.update(
            samples=len(src.records),
            train_pool=len([r for r in src.train_pool if r not in src.excluded]),
            test_pool=len([r for r in src.test_pool if r not in src.excluded]),
            label_free=len(src.label_free),
            excluded=len(src.excluded),
        )
        sources[name] = src

    plans = manifest_plans(protocol, sources, split_manifest, problems)
    rows = session_summary(protocol, plans)
    for session, plan, row in zip(protocol.sessions, plans, rows):
        missing = sorted({s.dataset for s in session.sources} - set(sources))
        if missing:
            row["skipped"] = f"dataset(s) {', '.join(missing)} unavailable"
        report.warnings += [f"session {plan.session} ({plan.name}): {s}" for s in plan.shortfalls]
    report.sessions = rows
    report.held_out = held_out_cases(plans)
    report.problems = _unique(problems)
    report.warnings = _unique(report.warnings)
    return report


def _background_only(name: str, src: DatasetSource) -> list[str]:
    """One line per training-pool sample whose label holds nothing but background: the session selection
    takes samples by the classes they show, so it is silently never used (and counts in no session)."""
    lines = []
    for rid in sorted(src.presence):
        if rid in src.excluded or rid not in src.train_pool or not set(src.presence[rid]) <= {0}:
            continue
        lines.append(
            f"{src.records[rid].label}: label holds only background, so no session of the protocol uses this "
            f"sample of dataset {name}; fix the label file if it should show classes, or drop the sample"
        )
    return lines


__all__ = ["CheckReport", "SessionPlan", "check_protocol"]
