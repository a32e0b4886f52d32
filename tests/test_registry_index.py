"""The registry index (``src/jascl/registry_index.json``, :mod:`jascl.registry`): what ``jascl methods`` and
``jascl backbones`` list without importing a method or a backbone.

* it agrees with the registrations, entry by entry (module, description, paper, options block and class, parts,
  for every task), so it cannot drift from the code;
* in a fresh interpreter, importing the module an entry names registers the entry (what first use does);
* the mechanics, on a registry and a package of the test's own: listing imports nothing, first use imports the
  entry's module, a stale index still finds a new entry, a user's module cannot take an indexed name.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
import uuid

import pytest

from jascl.errors import ConfigError
from jascl.methods.registry import METHODS
from jascl.networks.registry import BACKBONES
from jascl.registry import INDEX_FILE, Registry, index_of, read_index

FIX = "the registry index is stale: run 'python tools/registry_index.py' and commit src/jascl/registry_index.json"
STORED = read_index(INDEX_FILE)
ENTRIES = [(section, name) for section in sorted(STORED) for name in sorted(STORED[section])]


@functools.cache
def live() -> dict:
    """The index the registrations make (every method and backbone module imported), jascl's own entries only
    (a test may have registered a method of its own in this process)."""
    METHODS.load_all()
    made = index_of([*METHODS.task_registries(), BACKBONES])
    return {s: {n: r for n, r in entries.items() if r["module"].startswith("jascl.")} for s, entries in made.items()}


def test_the_index_lists_every_method_of_every_task_and_every_backbone():
    assert {"methods", "methods.detection", "backbones"} <= set(STORED)
    assert {"vanilla", "jascl", "jascl+gaps", "ewc"} <= set(STORED["methods"])
    assert {(s, n) for s, entries in live().items() for n in entries} == set(ENTRIES), FIX


@pytest.mark.parametrize(("section", "name"), ENTRIES, ids=[f"{s}:{n}" for s, n in ENTRIES])
def test_the_index_entry_is_what_the_registration_says(section, name):
    assert STORED[section][name] == live()[section].get(name), FIX


def test_a_registration_and_its_entry_by_hand():
    ewc = dict(STORED["methods"]["ewc"])
    assert ewc.pop("doc").startswith("baseline: elastic weight consolidation")
    assert ewc == {
        "module": "jascl.methods.baselines.regularization.ewc",
        "options": "jascl.methods.baselines.regularization.ewc.EWCOptions",
        "options_key": "ewc",
        "paper": "Kirkpatrick et al., PNAS 2017",
        "parts": [],
        "fidelity": "faithful",
        "flags": [],
    }
    assert STORED["methods.detection"]["ewc"]["module"] == "jascl.methods.detection.baselines"
    composed = STORED["methods"]["jascl+gaps"]  # registered where register_composition is called
    assert [composed[k] for k in ("module", "options_key", "parts")] == ["jascl.methods.presets", "", ["jascl", "gaps"]]
    assert STORED["backbones"]["unet"]["module"] == "jascl.networks.unet"


def test_methods_sharing_an_options_block_share_its_class():
    """``check_method_args`` reads a block with the class of any one method that reads it."""
    classes: dict[str, set[str]] = {}
    for record in STORED["methods"].values():
        if record["options"]:
            classes.setdefault(record["options_key"], set()).add(record["options"])
    assert {key: c for key, c in classes.items() if len(c) > 1} == {}
    assert classes["jascl"] == {"jascl.methods.presets.JasclOptions"}


@pytest.mark.slow
def test_importing_the_module_an_entry_names_registers_it():
    """In a fresh interpreter, module by module: what :meth:`Registry.get` imports on first use registers it."""
    code = textwrap.dedent(
        """
        import importlib, json
        from jascl.methods.registry import METHODS
        from jascl.networks.registry import BACKBONES
        from jascl.registry import read_index

        registries = {r.index_section: r for r in [*METHODS.task_registries(), BACKBONES]}
        missing = []
        for section, entries in sorted(read_index().items()):
            for module in sorted({record["module"] for record in entries.values()}):
                importlib.import_module(module)
                live = registries[section].records()
                missing += [f"{section}:{n}" for n, r in entries.items() if r["module"] == module and n not in live]
        print(json.dumps(missing))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package of the test's own with a registry indexed in ``index.json``: ``alpha`` (in the index, module
    ``a``) and ``beta`` (module ``b``, added since the index was written)."""
    name = f"regpkg_{uuid.uuid4().hex[:8]}"
    root = tmp_path / name
    root.mkdir()
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"things": {"alpha": {"module": f"{name}.a", "doc": "the alpha thing"}}}))
    (root / "__init__.py").write_text("")
    (root / "reg.py").write_text(
        "from pathlib import Path\nfrom jascl.registry import Registry\n"
        f"THINGS = Registry('thing', 'things', packages=({name!r},), index_file=Path({str(index)!r}))\n"
    )
    for module, entry in (("a", "alpha"), ("b", "beta")):
        (root / f"{module}.py").write_text(
            f"from {name}.reg import THINGS\n\n@THINGS.register({entry!r}, doc='the {entry} thing')\n"
            f"def make():\n    return {entry!r}\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    registry = importlib.import_module(f"{name}.reg").THINGS
    yield name, registry
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[module]


def test_listing_reads_the_index_and_first_use_imports_the_module(package):
    name, things = package
    assert things.list() == ["alpha"] and "alpha" in things and things.describe("alpha") == "the alpha thing"
    assert things.module("alpha") == f"{name}.a"
    assert f"{name}.a" not in sys.modules  # nothing imported to list or describe
    assert things.create("alpha") == "alpha"
    assert f"{name}.a" in sys.modules and f"{name}.b" not in sys.modules  # only its own module
    assert things.records() == {"alpha": {"module": f"{name}.a", "doc": "the alpha thing"}}


def test_a_stale_index_still_finds_a_new_entry_and_refuses_an_unknown_one_in_one_line(package):
    name, things = package
    assert "beta" not in things  # the index does not know it yet ...
    assert things.create("beta") == "beta"  # ... but first use imports every module of the package
    assert things.list() == ["alpha", "beta"] and things.describe("beta") == "the beta thing"
    with pytest.raises(ConfigError, match=r"^unknown thing 'gamma'; choose one of: alpha, beta$"):
        things.get("gamma")


def test_a_module_of_the_users_cannot_take_an_indexed_name_until_it_is_unregistered(package):
    name, things = package
    with pytest.raises(ValueError, match="thing 'alpha' is registered twice"):
        things.register("alpha")(lambda: "mine")  # this test module is not the one the index names
    things.unregister("alpha")  # imports alpha's module, then forgets the entry
    assert "alpha" not in things and things.list() == []
    things.register("alpha", doc="mine")(lambda: "mine")
    assert things.create("alpha") == "mine" and things.module("alpha") == __name__


def test_an_unindexed_registry_is_the_plain_one():
    plain: Registry[str] = Registry("widget")
    plain.register("w")(lambda: "w")
    assert plain.list() == ["w"] and plain.describe("w") == "" and plain.records()["w"]["module"] == __name__
    with pytest.raises(ConfigError, match="unknown widget 'x'; choose one of: w"):
        plain.get("x")
