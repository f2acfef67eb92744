"""The repository checkout this development package was installed from (editable install only)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvstrata"
EXAMPLES = REPO / "examples"
