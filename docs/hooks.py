"""MkDocs hook: the reference pages generated from the code (ark.cli.reference)."""

from __future__ import annotations

from typing import Any

from mkdocs.structure.files import File, Files


def on_files(files: Files, config: Any) -> Files:
    from ark.cli.reference import PAGES, page

    for path in PAGES:
        files.append(File.generated(config, path, content=page(path)))
    return files
