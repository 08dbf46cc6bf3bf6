"""NVIDIA device plugin's config, whose sharing section changes what a node advertises: the
file, or the GPU Operator's ConfigMap folder with the config a node label selects (the sharing
rules themselves are mig_agent.core.advertised's)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from mig_agent.config.yaml_files import parse, read
from mig_agent.core.advertised import NO_SHARING, Sharing, parse_sharing
from mig_agent.core.errors import ConfigError


def load_sharing(path: str | Path) -> Sharing:
    """The sharing config of one NVIDIA device plugin config file (YAML or JSON)."""
    return parse_sharing(parse(read(Path(path)), str(path)), source=str(path))


def device_plugin_sharing(
    path: str, node_labels: Mapping[str, str], *, label: str, default: str
) -> Sharing:
    """The sharing config NVIDIA's device plugin runs with on a node.

    ``path`` is one config file, or a folder of them (the GPU Operator's plugin ConfigMap as a
    volume: one file per config name). In a folder the config is chosen as the Operator's
    config-manager does: the one the node's ``label`` names (ConfigError if there is none of
    that name: the plugin would not start either), else ``default``, else none. Empty ``path``:
    no sharing.
    """
    if not path:
        return NO_SHARING
    folder = Path(path)
    if not folder.is_dir():
        return load_sharing(folder)
    # Dot-files are the ConfigMap volume's own links ('..data').
    names = sorted(f.name for f in folder.iterdir() if not f.name.startswith(".") and f.is_file())
    chosen, why = node_labels.get(label, ""), f"node label {label}"
    if not chosen:
        chosen, why = default, "the default device plugin config"
    if not chosen:
        return NO_SHARING
    if chosen not in names:
        raise ConfigError(
            f"{why} names config {chosen!r}, which {folder} does not have "
            f"(it has: {', '.join(names) or 'nothing'})",
            config=chosen,
        )
    return load_sharing(folder / chosen)
