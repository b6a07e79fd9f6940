"""mkdocs hook: replaces ``<!-- advisor-rules -->`` with the advisor's rule table, so the documentation
shows the rules lit_parallel applies (``lit_parallel.planner.rules.RULES``), never a copy of them."""

from lit_parallel.planner.rules import rules_markdown

MARKER = "<!-- advisor-rules -->"


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(MARKER, rules_markdown()) if MARKER in markdown else markdown
