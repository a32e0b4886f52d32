"""The JASCL paper as data: its result tables (``tables/*.yaml``) and the reader for them."""

from jascl.paper.tables import Cell, Column, PaperTable, Row, get_table, paper_tables

__all__ = ["Cell", "Column", "PaperTable", "Row", "get_table", "paper_tables"]
