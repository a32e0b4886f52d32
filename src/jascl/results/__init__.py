"""Result writers: comparison tables, Markdown, CSV and JSON reports for runs."""
