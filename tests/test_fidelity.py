"""Fidelity labels (issue 36): every registered method of every task carries one, well formed, in the registry index
(what ``jascl methods`` lists without imports); a composition's is its parts'; marks and footnotes by hand; a bad
label is refused at registration."""

import pytest

from jascl.errors import ConfigError
from jascl.methods import METHODS
from jascl.methods.fidelity import FLAGS, Fidelity, check_fidelity, combine, legend
from jascl.registry import INDEX_FILE, read_index
from jascl.results.fidelity import footnotes, mark, method_fidelity

INDEX = read_index(INDEX_FILE)
ENTRIES = [(section, name) for section in sorted(INDEX) if section.startswith("methods") for name in INDEX[section]]


@pytest.mark.parametrize(("section", "name"), ENTRIES, ids=[f"{s}:{n}" for s, n in ENTRIES])
def test_every_registered_method_carries_a_well_formed_fidelity_label(section, name):
    record = INDEX[section][name]
    check_fidelity(name, record["fidelity"], record["flags"])  # raises on a bad label
    assert record["fidelity"], f"{section}:{name} has no fidelity label"


def test_the_labels_the_issue_names():
    def fid(name):
        return method_fidelity(name)

    assert fid("nncsl").flags == ("uses exemplars",) and fid("star").flags == ("uses exemplars",)
    assert fid("mdil") == Fidelity("faithful", ("test-time domain oracle",))
    assert fid("halo").flags == ("annotation oracle",) and fid("cat").flags == ("uses exemplars",)
    for name in ("yooop", "yooop-plus", "fscil-ss", "maml-reg"):  # rebuilt from abstracts
        assert fid(name).kind == "reconstructed" and "abstract" in fid(name).label
    assert fid("bcm").kind == "faithful"  # its paper and official code were found this time
    assert fid("gen-replay").kind == "simplified" and "10493074" in fid("gen-replay").label
    assert fid("clip-driven").flags == ("pre-trained weights needed",)


def test_a_composition_carries_its_least_faithful_part_and_every_flag():
    assert method_fidelity("jascl+gaps") == Fidelity("faithful", ("uses exemplars",))
    combined = method_fidelity("gaps+maml")  # a composition nobody registered: built from the parts
    assert combined.kind == "simplified" and combined.label.startswith("simplified: maml: simplified: first-order")
    assert combined.flags == ("uses exemplars",)
    assert combine([("a", Fidelity("simplified: x")), ("b", Fidelity("reconstructed: y"))]).label == (
        "reconstructed: a: simplified: x; b: reconstructed: y"
    )
    assert combine([("a", Fidelity("faithful")), ("b", Fidelity(""))]).label == ""  # an unlabelled part


def test_marks_footnotes_and_legend_by_hand():
    assert Fidelity("simplified: x", ("uses exemplars", "annotation oracle")).mark == "S,E,A"
    assert Fidelity().mark == "?" and Fidelity().text() == "not stated"
    assert mark("vanilla") == "vanilla [F]" and mark("nncsl") == "nncsl [S,E]" and mark("nope") == "nope [?]"
    lines = footnotes(["mdil", "nope"])
    assert lines[0] == "Fidelity marks: F faithful, D test-time domain oracle, ? no label"
    assert lines[1:] == ["[F,D] mdil: faithful; test-time domain oracle", "[?] nope: not a registered method"]
    assert legend([Fidelity("reconstructed: z")]) == "Fidelity marks: R reconstructed"
    assert set(FLAGS) >= {"uses exemplars", "test-time domain oracle"}


@pytest.mark.parametrize(
    ("fidelity", "flags", "match"),
    [
        ("close enough", (), "use 'faithful', 'simplified: <what>'"),
        ("simplified:", (), "use 'faithful'"),
        ("faithful", ("clairvoyant",), "unknown fidelity flags"),
    ],
)
def test_a_bad_label_is_refused_at_registration(fidelity, flags, match):
    with pytest.raises(ConfigError, match=match):
        METHODS.register("fidelity-test-method", fidelity=fidelity, flags=flags)(lambda config: None)
    assert "fidelity-test-method" not in METHODS
