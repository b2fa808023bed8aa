"""mkdocs hooks: the repository's README.md is the site's index page.

The README stays at the root, where GitHub and PyPI show it, and is not copied
into docs/: its links into docs/ are rewritten for a site whose pages lie side
by side.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files


def on_files(files: Files, config: Any) -> Files:
    """Add README.md, links rewritten, as ``index.md``."""
    root = Path(config.config_file_path).parent
    text = re.sub(r"\]\(docs/", "](", (root / "README.md").read_text(encoding="utf-8"))

    def unlinked(link: re.Match[str]) -> str:
        # A file of the repository outside docs/ (examples/gpt/README.md) is not on the site:
        # its name stays, as text.
        return link.group(1) if (root / link.group(2)).exists() else link.group(0)

    text = re.sub(r"\[([^\]]+)\]\(((?:examples|lib|tests|benchmarks)/[^)#]+)\)", unlinked, text)
    files.append(File.generated(config, "index.md", content=text))
    return files
