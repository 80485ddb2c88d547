"""Sphinx configuration: the user manual (README.md's sections) and the API reference.

Sphinx, as for PyTorch's own documentation: the docstrings are reStructuredText with
cross-reference roles, which autodoc renders as written; MyST includes the README's sections
as pages, so the manual has one source.
"""

import lightning_distgrad

project = "lightning_distgrad"
release = version = lightning_distgrad.__version__
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "lightning_distgrad"
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Builds offline: links to torch/Python/Lightning objects stay plain text.
intersphinx_mapping: dict = {}
nitpicky = False
# The README's pages start at its "##" headings.
suppress_warnings = ["myst.header"]


def _readme_links_to_pages(app, relative_path, parent_docname, content):
    """The README links to slurm/README.md and CHANGELOG.md, which the docs serve as the pages
    ``slurm`` and ``changelog``."""
    content[0] = content[0].replace("](slurm/README.md)", "](slurm.md)")
    content[0] = content[0].replace("](CHANGELOG.md)", "](changelog.md)")


def setup(app):
    app.connect("include-read", _readme_links_to_pages)
