"""Notebooks execute top to bottom (slow tier; `.ci/run` runs it after the default tier): the format tour,
the compressed/uncompressed attention comparison on the embedded SmolLM2's real KV, and generation side
by side in both KV formats."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_are_found():
  assert {"format_tour.ipynb", "compare_attention.ipynb", "generation_side_by_side.ipynb"} <= {p.name for p in NOTEBOOKS}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parents[1])}}).execute()
