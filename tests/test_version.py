"""attnselect's version (attnselect.version): the package's, its installed metadata's, a PEP 440 release."""

from __future__ import annotations

import importlib.metadata
import re

import attnselect
from attnselect import version


def test_the_version_is_the_packages_and_the_builds():
    assert attnselect.__version__ == version.__version__
    assert importlib.metadata.version("attnselect") == version.__version__  # pyproject.toml reads it at build
    assert re.fullmatch(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?", version.__version__)
