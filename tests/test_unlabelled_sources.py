"""Unlabelled samples borrowed from other sources (``unlabelled_sources``): the key, the pools it builds on synthetic
and dataset protocols, the leakage rules, the manifest, and the reproduce table's ``unlabelled_extra``."""

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import toy_protocol_dict  # noqa: E402
from fixtures import medical as fxm  # noqa: E402
from jascl.data.noise import DegradedSamples  # noqa: E402
from jascl.data.real import load_real, manifest_dict, open_sources, plan_sessions, resolve_roots  # noqa: E402
from jascl.data.sessions import load_sessions  # noqa: E402
from jascl.errors import ConfigError, DataError  # noqa: E402
from jascl.protocols import get_protocol, parse_protocol, with_unlabelled_extra  # noqa: E402
from jascl.protocols.schema import IGNORE_INDEX, UnlabelledSourceSpec  # noqa: E402
from jascl.results.runs import protocol_from_resolved  # noqa: E402

QUIET = {"echo": lambda *a: None}

# --------------------------------------------------------------------------------------------- synthetic


def toy_borrowing(count: int = 4, **top) -> dict:
    """The two-session toy (domain a: plain, domain b: inverted); session 1 has 3 own pool images, 1 validation
    image per class and borrows ``count`` images from domain a."""
    d = toy_protocol_dict()
    d["sessions"][1].update(unlabelled=3, validation=1, unlabelled_sources=[{"domain": "a", "count": count}])
    d.update(top)
    return d


def test_synthetic_pool_borrows_rendered_samples_of_the_named_domain(tmp_path):
    protocol = parse_protocol(toy_borrowing(4), "toy.yaml")
    assert protocol.sessions[1].unlabelled_sources == (UnlabelledSourceSpec(4, domain="a"),)
    data = load_sessions(protocol, tmp_path, **QUIET)
    pool = data[1].unlabelled
    assert len(pool) == 3 + 4
    borrowed = [i for i, ref in enumerate(pool.ids) if "/extra-a/" in ref]
    assert borrowed == [3, 4, 5, 6] and pool.ids[3] == "s1-inc/extra-a/00000"
    # the domains' intensity signature: a has background 0.1, b is inverted (background about 0.9)
    medians = [float(np.median(pool.images[i])) for i in range(len(pool))]
    assert all(m < 0.3 for m in medians[3:]) and all(m > 0.7 for m in medians[:3]), medians
    # images only: no ground truth for the borrowed samples; the own pool keeps its hidden truth
    assert all((pool.labels[i] == IGNORE_INDEX).all() for i in borrowed)
    assert all((pool.labels[i] != IGNORE_INDEX).all() for i in range(3))
    # leakage: no id of any test / validation / labelled split is in the pool
    others = {ref for d in data for s in (d.train, d.test, d.validation) if s is not None for ref in s.ids}
    assert not others & set(pool.ids) and len(set(pool.ids)) == len(pool)
    # every other split (the own pool's images included) is the one of the protocol without the key
    plain = toy_borrowing(0)
    del plain["sessions"][1]["unlabelled_sources"]
    before = load_sessions(parse_protocol(plain, "toy.yaml"), tmp_path, **QUIET)
    assert np.array_equal(before[1].unlabelled.images, pool.images[:3])
    for split in ("train", "test", "validation"):
        assert np.array_equal(getattr(before[1], split).images, getattr(data[1], split).images)
    # deterministic in (seed, protocol): regenerated in another cache, the same pixels
    again = load_sessions(protocol, tmp_path / "other", **QUIET)
    assert again[1].unlabelled.ids == pool.ids and np.array_equal(again[1].unlabelled.images, pool.images)


def test_synthetic_borrowed_samples_are_degraded_with_the_pool_and_named_in_the_manifest(tmp_path):
    clean = load_sessions(parse_protocol(toy_borrowing(4), "toy.yaml"), tmp_path, **QUIET)
    noisy_protocol = parse_protocol(toy_borrowing(4, unlabelled_noise="heavy"), "toy.yaml")
    noisy = load_sessions(noisy_protocol, tmp_path, **QUIET)
    a, b = clean[1].unlabelled, noisy[1].unlabelled
    changed = [i for i in range(len(a)) if not np.array_equal(a.images[i], b.images[i])]
    # 70 % of the 7 pool images (5) are degraded, so at least 2 of the 4 borrowed ones
    assert len(changed) == 5 and len([i for i in changed if i >= 3]) >= 2
    manifest = manifest_dict(noisy_protocol, noisy)
    entry = manifest["sessions"][1]
    assert entry["unlabelled_sources"] == [{"domain": "a", "ids": [f"s1-inc/extra-a/{i:05d}" for i in range(4)]}]
    assert entry["unlabelled"] == b.ids and "unlabelled_sources" not in manifest["sessions"][0]
    # a manifest reused with --split-manifest must borrow what the protocol asks for
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    assert load_sessions(noisy_protocol, tmp_path, split_manifest=path, **QUIET)[1].unlabelled.ids == b.ids
    entry["unlabelled_sources"][0]["ids"].pop()
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"borrows unlabelled samples \{'a': 3\}.*ask for \{'a': 4\}"):
        load_sessions(noisy_protocol, tmp_path, split_manifest=path, **QUIET)


def test_resolved_protocol_round_trips_the_key():
    protocol = parse_protocol(toy_borrowing(4), "toy.yaml")
    resolved = json.loads(json.dumps(__import__("dataclasses").asdict(protocol), default=list))
    assert protocol_from_resolved(resolved).sessions[1].unlabelled_sources == (UnlabelledSourceSpec(4, domain="a"),)


# --------------------------------------------------------------------------------------------- malformed keys


def _set(sources):
    def edit(d):
        d["sessions"][1]["unlabelled_sources"] = sources

    return edit


def _three_sessions(d):
    """A third session in a new domain c, borrowing from domain b, which session 1 introduces."""
    d["domains"]["c"] = {}
    d["sessions"].append({"name": "late", "domains": ["c"], "new_classes": [], "recurring_classes": [2], "shots": 1})


@pytest.mark.parametrize(
    "edit, key, reason",
    [
        (_set([{"domain": "zz", "count": 2}]), "unlabelled_sources[0].domain", "domain 'zz' is not declared"),
        (
            _set([{"domain": "a", "count": -2}]),
            "unlabelled_sources[0].count",
            "non-negative number of samples (got -2)",
        ),
        (_set([{"domain": "a", "count": "4"}]), "unlabelled_sources[0].count", "non-negative"),
        (_set([{"dataset": "a", "count": 2}]), "unlabelled_sources[0]", "borrows rendered samples of a domain"),
        (_set([{"domain": "a", "n": 2}]), "unlabelled_sources[0].n", "unknown key"),
        (_set([{"domain": "a"}]), "unlabelled_sources[0].count", "is required"),
        (_set({"domain": "a", "count": 2}), "unlabelled_sources", "must be a list"),
        (_set([{"domain": "a", "count": 1}, {"domain": "a", "count": 2}]), "unlabelled_sources[1]", "twice"),
        (_set([{"domain": "b", "count": 2}]), "unlabelled_sources[0].domain", "one of the session's own domains"),
    ],
)
def test_malformed_unlabelled_sources_are_one_line(edit, key, reason):
    d = toy_protocol_dict()
    edit(d)
    with pytest.raises(ConfigError) as info:
        parse_protocol(d, "toy.yaml")
    message = str(info.value)
    assert message.startswith(f"toy.yaml: sessions[1].{key}: ") and reason in message and "\n" not in message, message


def test_a_domain_no_earlier_session_has_is_refused():
    d = toy_protocol_dict()
    _three_sessions(d)
    d["sessions"][1]["unlabelled_sources"] = [{"domain": "c", "count": 1}]  # c comes with session 2, later
    with pytest.raises(
        ConfigError,
        match=r"sessions\[1\].unlabelled_sources\[0\].domain: domain 'c' is not a "
        r"domain of an earlier session; borrow from one of a$",
    ):
        parse_protocol(d, "toy.yaml")
    d["sessions"][1]["unlabelled_sources"] = []
    d["sessions"][2]["unlabelled_sources"] = [{"domain": "b", "count": 1}, {"domain": "a", "count": 0}]
    assert parse_protocol(d, "toy.yaml").sessions[2].unlabelled_extra == 1


# --------------------------------------------------------------------------------------------- datasets


def ct_protocol(count: int, **top) -> dict:
    """Two MSD-layout CT datasets: session 0 learns classes 1, 2 from ``ct_a`` (2 labelled, 1 validation sample),
    session 1 class 3 from ``ct_b`` (1 shot, 1 own unlabelled sample) and borrows ``count`` from ``ct_a``."""
    return {
        "name": "ct-borrow",
        "seed": 11,
        "spatial_dims": 3,
        "in_channels": 1,
        "classes": [
            {"id": 0, "name": "background"},
            {"id": 1, "name": "one"},
            {"id": 2, "name": "two"},
            {"id": 3, "name": "three"},
        ],
        "domains": {"da": {}, "db": {}},
        "datasets": {
            "ct_a": {"layout": "msd", "domain": "da", "labels": {1: "one", 2: "two"}},
            "ct_b": {"layout": "msd", "domain": "db", "labels": {1: "three"}},
        },
        "sessions": [
            {
                "name": "a",
                "domains": ["da"],
                "new_classes": [1, 2],
                "shots": "all",
                "train": 2,
                "validation": 1,
                "sources": ["ct_a"],
            },
            {
                "name": "b",
                "domains": ["db"],
                "new_classes": [3],
                "shots": 1,
                "unlabelled": 1,
                "sources": ["ct_b"],
                "unlabelled_sources": [{"dataset": "ct_a", "count": count}],
            },
        ],
        **top,
    }


@pytest.fixture
def ct_roots(tmp_path):
    # ct_a: 6 labelled cases (one held out for testing, test_fraction 0.2) and 2 label-free imagesTs cases
    return {
        "ct_a": fxm.write_msd(tmp_path / "ct_a", cases=6, labels=(1, 2), test_cases=2, seed=1),
        "ct_b": fxm.write_msd(tmp_path / "ct_b", cases=4, labels=(1,), test_cases=1, seed=2),
    }


def _plans(protocol, roots, cache):
    sources = open_sources(protocol, resolve_roots(protocol, roots), cache, **QUIET)
    return sources, plan_sessions(protocol, sources, **QUIET)


def test_dataset_pool_borrows_the_named_datasets_non_test_unlabelled_cases(ct_roots, tmp_path):
    protocol = parse_protocol(ct_protocol(4), "ct.yaml")
    sources, plans = _plans(protocol, ct_roots, tmp_path / "cache")
    a = sources["ct_a"]
    assert len(a.train_pool) == 5 and len(a.test_pool) == 1 and len(a.label_free) == 2
    base = plans[0]
    assert len(base.train) == 2 and len(base.validation or []) == 1
    # everything ct_a has that is no test, validation or labelled sample: 5 + 2 - 2 - 1 = 4, all borrowed
    expected = {f"ct_a/{r}" for r in a.train_pool + a.label_free} - set(base.train) - set(base.validation or [])
    pool = set(plans[1].unlabelled or [])
    borrowed = {r for r in pool if r.startswith("ct_a/")}
    assert borrowed == expected and len(borrowed) == 4
    assert len(pool - borrowed) == 1 and all(r.startswith("ct_b/") for r in pool - borrowed)
    labelled = {r for p in plans for r in [*p.train, *p.test, *(p.validation or [])]}
    assert not labelled & pool and not {f"ct_a/{r}" for r in a.test_pool} & pool
    # borrowing leaves every other split of every session as it was
    _, without = _plans(parse_protocol(ct_protocol(0), "ct.yaml"), ct_roots, tmp_path / "cache")
    for p, q in zip(plans, without):
        assert (p.train, p.test, p.validation) == (q.train, q.test, q.validation)
    assert sorted(set(without[1].unlabelled or []) | borrowed) == plans[1].unlabelled
    # one more than there is: one line naming the file, the key and how many are available
    with pytest.raises(DataError) as info:
        _plans(parse_protocol(ct_protocol(5), "ct.yaml"), ct_roots, tmp_path / "cache")
    message = str(info.value)
    assert (
        message.startswith(
            "ct.yaml: sessions[1].unlabelled_sources[0].count: 5 samples asked from dataset 'ct_a', only 4 available"
        )
        and "\n" not in message
    ), message


def test_dataset_draw_is_seeded_and_lazy_pool_has_images_only(ct_roots, tmp_path):
    two = parse_protocol(ct_protocol(2), "ct.yaml")
    first = _plans(two, ct_roots, tmp_path / "cache")[1][1].unlabelled
    assert first == _plans(two, ct_roots, tmp_path / "cache")[1][1].unlabelled
    reseeded = [parse_protocol({**ct_protocol(2), "seed": s}, "ct.yaml") for s in range(6)]
    draws = {tuple(_plans(p, ct_roots, tmp_path / "cache")[1][1].unlabelled or ()) for p in reseeded}
    assert len(draws) > 1  # the seed chooses which two
    noisy = parse_protocol(ct_protocol(2, unlabelled_noise="moderate"), "ct.yaml")
    data = load_sessions(noisy, tmp_path / "cache", roots=ct_roots, patch_size=[8, 8, 8], **QUIET)
    pool = data[1].unlabelled
    assert isinstance(pool.images, DegradedSamples) and len(pool) == 3
    for i, ref in enumerate(pool.ids):
        image, label = pool.images[i], pool.labels[i]
        assert image.shape == (1, 8, 8, 8)
        if ref.startswith("ct_a/"):  # borrowed: no ground truth, although class 1 / 2 are taught from ct_a
            assert (label == IGNORE_INDEX).all()


def test_dataset_manifest_names_the_lender_and_is_reused_and_checked(ct_roots, tmp_path):
    protocol = parse_protocol(ct_protocol(3), "ct.yaml")
    data, manifest = load_real(protocol, ct_roots, tmp_path / "cache", **QUIET)
    entry = manifest["sessions"][1]
    (lent,) = entry["unlabelled_sources"]
    assert lent["dataset"] == "ct_a" and len(lent["ids"]) == 3 and set(lent["ids"]) < set(entry["unlabelled"])
    assert all(ref.startswith("ct_a/") for ref in lent["ids"])
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(manifest))
    reused, _ = load_real(protocol, ct_roots, tmp_path / "cache", split_manifest=path, **QUIET)
    assert reused[1].unlabelled.ids == data[1].unlabelled.ids

    def broken(edit, fragment):
        m = copy.deepcopy(manifest)
        edit(m["sessions"][1])
        path.write_text(json.dumps(m))
        with pytest.raises(DataError) as info:
            load_real(protocol, ct_roots, tmp_path / "cache", split_manifest=path, **QUIET)
        assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)

    def swap(e, ref):
        e["unlabelled"][e["unlabelled"].index(lent["ids"][0])] = ref
        e["unlabelled_sources"][0]["ids"][0] = ref

    shot = manifest["sessions"][0]["train"][0]
    broken(lambda e: swap(e, shot), "is a labelled training or validation sample of a session")
    broken(lambda e: swap(e, manifest["sessions"][0]["test"][0]), "is borrowed from dataset ct_a's test pool")
    broken(lambda e: e.pop("unlabelled_sources"), "the protocol's unlabelled_sources ask for {'ct_a': 3}")


@pytest.mark.parametrize(
    "sources, key, reason",
    [
        (
            [{"dataset": "ct_zz", "count": 1}],
            "[0].dataset",
            "dataset 'ct_zz' is not declared under 'datasets'; name one of ct_a, ct_b",
        ),
        ([{"dataset": "ct_a", "count": -1}], "[0].count", "got -1"),
        ([{"domain": "da", "count": 1}], "[0]", "borrows from a dataset entry"),
        ([{"dataset": "ct_b", "count": 1}], "[0].dataset", "one of the session's own sources"),
    ],
)
def test_malformed_dataset_unlabelled_sources_are_one_line(sources, key, reason):
    d = ct_protocol(1)
    d["sessions"][1]["unlabelled_sources"] = sources
    with pytest.raises(ConfigError) as info:
        parse_protocol(d, "ct.yaml")
    message = str(info.value)
    assert message.startswith(f"ct.yaml: sessions[1].unlabelled_sources{key}: ") and reason in message, message


def test_a_later_sessions_dataset_is_refused():
    d = ct_protocol(1)
    d["sessions"][1].pop("unlabelled_sources")
    d["sessions"][0]["unlabelled_sources"] = [{"dataset": "ct_b", "count": 1}]
    with pytest.raises(
        ConfigError,
        match=r"sessions\[0\].unlabelled_sources\[0\].dataset: dataset 'ct_b' is first "
        r"used by session 1, after this one",
    ):
        parse_protocol(d, "ct.yaml")


# --------------------------------------------------------------------------------------------- unlabelled_extra


def test_unlabelled_extra_resolves_to_the_earlier_sessions_sources():
    med = with_unlabelled_extra(get_protocol("med-ss"), 4, 42)
    assert med.name == "med-ss-s4extra42"
    assert [(u.dataset, u.count) for u in med.sessions[4].unlabelled_sources] == [
        ("ts", 11),
        ("amos", 11),
        ("bcv", 10),
        ("mots_hepaticvessel", 4),
        ("mots_colon", 3),
        ("mots_lung", 3),
    ]
    assert med.sessions[4].unlabelled == 15 and med.sessions[4].unlabelled_extra == 42
    assert [s.unlabelled_sources for i, s in enumerate(med.sessions) if i != 4] == [()] * 5
    stand_in = with_unlabelled_extra(get_protocol("synthetic-2d-ss"), 3, 42)
    assert [(u.domain, u.count) for u in stand_in.sessions[3].unlabelled_sources] == [
        ("ct", 14),
        ("mri", 14),
        ("us", 14),
    ]
    assert [
        (u.domain, u.count)
        for u in with_unlabelled_extra(get_protocol("synthetic-2d-ss"), 2, 3).sessions[2].unlabelled_sources
    ] == [("ct", 2), ("mri", 1)]
    with pytest.raises(ConfigError, match="no earlier session has a source"):
        with_unlabelled_extra(get_protocol("med-ss"), 0, 4)
    with pytest.raises(ConfigError, match="has sessions 0-5"):
        with_unlabelled_extra(get_protocol("med-ss"), 6, 4)
