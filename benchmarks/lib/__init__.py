"""What the benchmarks share, and the tests with them: the repository's root (`REPO`) and its configs
(`config_path`), a table written between its markers in a markdown file (`markdown`), a built step looked at from
outside (`steps`), a process tree's peak memory (`processes`), a real GCS server on this machine (`gcs`) and the
recorded results (`results`). Imports zerolm, never a benchmark."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def config_path(config: str) -> Path:
    """A shipped config by its name (`125m`: configs/125m.yaml), or any YAML file by its path."""
    return Path(config) if config.endswith(".yaml") else REPO / "configs" / f"{config}.yaml"
