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
    readme = Path(config.config_file_path).parent / "README.md"
    text = re.sub(r"\]\(docs/", "](", readme.read_text(encoding="utf-8"))
    files.append(File.generated(config, "index.md", content=text))
    return files
