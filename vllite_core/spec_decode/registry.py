"""Proposers by method name, from every plugin's ``vllite_register_spec_proposers`` hook."""
from __future__ import annotations

from typing import Any, Callable

from vllite_core.config.speculative import SpeculativeConfig
from vllite_core.errors import ConfigError


def spec_proposer_factories(plugin_manager: Any = None) -> dict[str, Callable[..., Any]]:
    if plugin_manager is None:
        from vllite_core.plugins.manager import get_plugin_manager

        plugin_manager = get_plugin_manager()
    found: dict[str, Callable[..., Any]] = {}
    # pluggy answers last-registered first: reversed, a plugin's name replaces a built-in's.
    for answer in reversed(plugin_manager.hook.vllite_register_spec_proposers()):
        found.update(answer or {})
    return found


def resolve_proposer_factory(spec_config: SpeculativeConfig, plugin_manager: Any = None) -> Callable[..., Any]:
    """The factory of ``spec_config.method``; ConfigError naming the known methods."""
    factories = spec_proposer_factories(plugin_manager)
    if spec_config.method not in factories:
        raise ConfigError(f"speculative_config.method: unknown method {spec_config.method!r}; known: "
                          f"{', '.join(sorted(factories)) or 'none'}")
    return factories[spec_config.method]
