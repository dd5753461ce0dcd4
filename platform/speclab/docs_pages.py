"""The generated pages of the docs site (``make docs``): ``docs/configuration.md`` from
the config models (:mod:`speclab.config.reference`) and ``docs/index.md``, the site's
home, from the README (its ``docs/`` links made relative to the site).

``python -m speclab.docs_pages`` writes both; a test keeps them equal to their sources.
"""

from __future__ import annotations

import re

from speclab.config.reference import reference
from speclab.paths import repo_root


def index_page(readme: str) -> str:
    """The README as the site's home page: ``](docs/x)`` links become ``](x)``."""
    return re.sub(r"\]\(docs/", "](", readme)


def pages() -> dict[str, str]:
    """``{path under docs/: text}`` of every generated page."""
    readme = (repo_root() / "README.md").read_text()
    return {"index.md": index_page(readme), "configuration.md": reference()}


def main() -> None:
    docs = repo_root() / "docs"
    for name, text in pages().items():
        (docs / name).write_text(text)
        print(f"wrote docs/{name}")


if __name__ == "__main__":
    main()
