"""headsearch-bitext: a headsearch task plugin (docs/plugins.md walks through it)."""
from pathlib import Path

SPACE = Path(__file__).with_name("space.yaml")  # its search space: `headsearch run --space <this path>`
