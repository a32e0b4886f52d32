"""`jascl methods --paper`: every method of the paper's tables, with its jascl name, family, paper and status."""

from jascl.cli import main
from jascl.cli.listing import paper_methods
from jascl.methods import METHODS
from jascl.paper.tables import methods_in_tables


def test_every_method_of_the_paper_tables_is_listed_with_its_status():
    rows = {r["name"]: r for r in paper_methods()}
    assert set(rows) == set(methods_in_tables())
    assert rows["vanilla"]["family"] == "fine-tuning" and rows["jascl"]["family"] == "jascl"
    assert rows["c-fscil"]["family"] == "fewshot" and rows["c-fscil"]["paper"] == METHODS.info("c-fscil").paper
    assert "C-FSCIL" in rows["c-fscil"]["paper_rows"] and "class_0" not in rows["c-fscil"]["paper_rows"]
    # a composition is in the family of its first part; the paper's "w/o PAS" row has its preset
    assert rows["jascl+gaps"]["family"] == "jascl" and rows["jascl+gaps"]["status"] == "registered"
    assert rows["jascl-no-pas"]["family"] == "jascl"
    assert all((r["status"] == "registered") == (name in METHODS) for name, r in rows.items())
    # every method of the paper's tables is registered (issue 17: NNCSL ... Gen-Replay, CLIP-CT, jascl+gaps)
    assert [name for name, r in rows.items() if r["status"] != "registered"] == []
    assert rows["clip-ct"]["family"] == "distillation" and rows["cat"]["family"] == "surgery"
    # registered first, then the rest, each alphabetically
    order = [(r["status"] != "registered", r["name"]) for r in paper_methods()]
    assert order == sorted(order)


def test_cli_prints_the_count(capsys):
    assert main(["methods", "--paper"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    rows = paper_methods()
    done = sum(r["status"] == "registered" for r in rows)
    assert f"methods of the paper's tables: {done} of {len(rows)} registered" in out
