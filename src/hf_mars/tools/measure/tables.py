"""The one Markdown table renderer of the tools (τ tables, pass costs, the model card's table)."""

from __future__ import annotations


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: `head` names the columns, each row gives its cells as text, in order."""
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
