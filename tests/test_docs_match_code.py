"""Facts the README states that the code decides: they must say the same thing."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_names_the_default_pipeline():
    from k3c.passes.pipeline import PIPELINES

    text = (ROOT / "README.md").read_text()
    m = re.search(r"The default pipeline is `([^`]*)`", text)
    assert m, "README.md: the sentence naming the default pipeline is missing"
    assert tuple(p.strip() for p in m.group(1).split(",")) == PIPELINES["default"]
